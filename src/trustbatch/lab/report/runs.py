"""The runs of one experiment as the report reads them (``lab.records``: files or a packed archive), and the
numbers over them: means and standard errors over seeds, per-round and per-optimizer-step series, within-round
means, scores and collapses, token log-ratio histograms and their quantiles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from .. import records
from ..stats import collapse_reason, primary_score


def mean_se(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error s/√n with the sample SD s) of the finite values of ``xs``, None skipped; NaN for the
    mean without a value, for the error with fewer than two."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def load_runs(exp_dir: Path) -> dict[str, list[dict]]:
    """{arm: [run, ...]} for the finished runs; a run is {"seed", "metrics", "ratios", "steps", "summary"}
    (``steps``: the per-optimizer-step records of ``steps.jsonl``, empty for a run with one step per round or
    one from before the file existed)."""
    arms: dict[str, list[dict]] = {}
    spec = yaml.safe_load((exp_dir / "experiment.yaml").read_text()) if (exp_dir / "experiment.yaml").exists() else {}
    order = list((spec or {}).get("arms", {})) or records.arm_names(exp_dir)
    for arm in order:
        for d in records.finished_runs(exp_dir, arm):
            arms.setdefault(arm, []).append({
                "seed": int(d.name.removeprefix("seed")), "metrics": records.read_jsonl(d / "metrics.jsonl"),
                "ratios": records.read_jsonl(d / "ratios.jsonl") if records.exists(d / "ratios.jsonl") else [],
                "summary": json.loads(records.read_text(d / "summary.json")),
                "steps": records.read_jsonl(d / "steps.jsonl") if records.exists(d / "steps.jsonl") else [],
            })
    return arms


def _over_seeds(points: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """(x, mean, standard error) over runs of per-run {x: value} points, at every x any run has."""
    xs = sorted({x for p in points for x in p})
    mean, se = [], []
    for x in xs:
        m, e = mean_se([p[x] for p in points if x in p])
        mean.append(m)
        se.append(0.0 if math.isnan(e) else e)
    return xs, mean, se


def series(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard error over seeds of ``key`` at each rollout round."""
    return _over_seeds([{r["step"]: r[key] for r in run["metrics"] if key in r} for run in runs])


def trace_points(run: dict, key: str) -> dict[int, float]:
    """{optimizer step (1-based, counted over the run): value of ``key``} for one run.

    From ``steps.jsonl`` where the run has it: round r's step j of S is at (r − 1)·S + j + 1. Otherwise (and for
    a key the step records lack) from the round records of ``metrics.jsonl``, each placed at the round's last
    optimizer step r·S (S: the record's ``optimizer_steps``, 1 when absent), so a replayed run from before
    ``steps.jsonl`` shows its round means at the right place on the same axis.
    """
    if any(key in r for r in run.get("steps", [])):
        per_round = max(int(r["opt_step"]) for r in run["steps"]) + 1
        return {(r["step"] - 1) * per_round + int(r["opt_step"]) + 1: r[key] for r in run["steps"] if key in r}
    # a source metric (sample age) has no per-step record: it is the round's
    return {r["step"] * int(r.get("optimizer_steps", 1)): r[key] for r in run["metrics"]
            if key in r and r["step"] > 0}


def trace_series(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """``series`` over optimizer steps (``trace_points``): mean and standard error over seeds at each step."""
    return _over_seeds([trace_points(run, key) for run in runs])


def within_round(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """(step indices j, mean, standard error over seeds) of ``key`` at each optimizer step index j = 1..S of a round.

    Each seed contributes its mean over rounds of the j-th step's value (``steps.jsonl``), so the error is over
    seeds, as in the other traces. Empty for runs without per-step records (one step per round, or from before the
    file existed). Shows how one batch drifts as the policy moves away from it during a round's S steps.
    """
    per_seed = []
    for run in runs:
        by_j: dict[int, list[float]] = {}
        for r in run.get("steps", []):
            if key in r:
                by_j.setdefault(int(r["opt_step"]) + 1, []).append(r[key])
        if by_j:
            per_seed.append({j: sum(v) / len(v) for j, v in by_j.items()})
    return _over_seeds(per_seed)


def over_steps(runs: list[dict], key: str) -> float:
    """Mean over seeds of each run's mean of ``key`` over its optimizer steps (nan when never logged)."""
    return mean_se([sum(v) / len(v) for run in runs
                     if (v := [r[key] for r in run["metrics"] if key in r and r["step"] > 0])])[0]


def run_scores(run: dict) -> tuple[list[tuple[int, float]], list[float]]:
    """(held-out evaluations as (round, pass@1), training reward per round) of one run."""
    evals = [(r["step"], r["heldout_accuracy"]) for r in run["metrics"] if "heldout_accuracy" in r]
    rewards = [r["reward_mean"] for r in run["metrics"] if r["step"] > 0 and "reward_mean" in r]
    return evals, rewards


def arm_scores(runs: list[dict]) -> tuple[dict[int, float], dict[int, str | None], dict[int, float]]:
    """({seed: primary score}, {seed: collapse reason or None}, {seed: base pass@1}) for one arm's runs; a run
    either has all three or none (``unscored`` says why)."""
    scores, collapses, bases = {}, {}, {}
    for run in runs:
        scored = _scored(run)
        if isinstance(scored, tuple):
            scores[run["seed"]], collapses[run["seed"]], bases[run["seed"]] = scored
    return scores, collapses, bases


def unscored(runs: list[dict]) -> dict[int, str]:
    """{seed: why} of the finished runs ``arm_scores`` leaves out (too few held-out evaluations, no round-0 one)."""
    return {run["seed"]: why for run in runs if isinstance(why := _scored(run), str)}


def _scored(run: dict) -> tuple[float, str | None, float] | str:
    """(primary score, collapse reason or None, base pass@1) of one run, or why it has none: both rules must read
    it, so a run the collapse rule cannot read is not compared either."""
    evals, rewards = run_scores(run)
    try:
        score, why = primary_score(evals), collapse_reason(evals, rewards)
    except ValueError as e:
        return str(e).split(";")[0]
    return score, why, next((v for s, v in evals if s == 0), float("nan"))


def histogram_quantile(edges: list[float], counts: list[int], q: float) -> float:
    """The q-quantile (0 ≤ q ≤ 1) of a histogram, interpolated linearly inside the bin where it falls."""
    total = sum(counts)
    if total == 0:
        return float("nan")
    target, acc = q * total, 0.0
    for lo, hi, c in zip(edges[:-1], edges[1:], counts):
        if c and acc + c >= target:
            return lo + (hi - lo) * (target - acc) / c
        acc += c
    return edges[-1]


def step_histograms(arms: dict[str, list[dict]]) -> dict[str, tuple[list[float], dict[int, list[int]]]]:
    """{arm: (bin edges, {optimizer step within the round: token counts summed over rounds and seeds})} for
    the arms whose ratios.jsonl has per-optimizer-step records (more than one optimizer step per round)."""
    per_arm = {}
    for arm, runs in arms.items():
        recs = [r for run in runs for r in run["ratios"] if "opt_step" in r]
        if recs:
            by_step: dict[int, list[int]] = {}
            for r in recs:
                acc = by_step.setdefault(r["opt_step"], [0] * len(r["counts"]))
                by_step[r["opt_step"]] = [a + c for a, c in zip(acc, r["counts"])]
            per_arm[arm] = (recs[0]["edges"], dict(sorted(by_step.items())))
    return per_arm


def step_exact_quantiles(runs: list[dict]) -> dict[int, tuple[float, float, float]]:
    """{optimizer step within the round: (5%, 50%, 95%)}, each the median over the step's records of their
    exact quantile, for the steps whose every record has them."""
    import statistics

    by_step: dict[int, list[dict]] = {}
    for r in (r for run in runs for r in run["ratios"] if "opt_step" in r):
        by_step.setdefault(r["opt_step"], []).append(r)
    return {j: tuple(statistics.median(r["quantiles"][q] for r in recs) for q in ("0.05", "0.5", "0.95"))
            for j, recs in by_step.items() if all("quantiles" in r for r in recs)}


def run_config(path: Path) -> dict:
    """A run's resolved config (``ARM/seedK.yaml``, a file or packed), parsed with libyaml where PyYAML has it: the
    report reads two per run, hundreds in all, and the pure-Python parser spent most of the report's time on them."""
    return yaml.load(records.read_text(path), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
