"""``trustbatch lab report``: pre-flight table, dose–response, curves, per-step traces, ratio histograms, verdicts.

Everything in the report is computed from the run directories; the findings are the rules of
``trustbatch.lab.stats`` applied to the numbers, not hand-written. Those rules were fixed before the runs except
one, "both collapse" (``stats.POST_HOC_RULE``), which is post hoc: the report says so in its header and, beside
each verdict that rule decided, what the rules fixed before the runs read.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from datetime import datetime
from pathlib import Path

import yaml

from ..errors import UserError
from ..records import atomic_write, git_commit
from . import records
from .reproduce import reproduced_line
from .calls import WALL, covered_seconds, elapsed_seconds, load_calls
from .experiment import LAB_COMMON, default_comparisons, family_and_dose
from .preflight import CONTROL_COSINE, CONTROL_ZEROED
from .stats import (EQUIVALENCE_RULE, MARGIN, POST_HOC_RULE, POWER, collapse_reason, paired_interval, pick_tuned,
                    primary_score, tost)

# Issue 14's budget: each experiment at most 40 minutes wall-clock on the 2-core machine.
BUDGET_MIN = 40.0

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _fmt(x: float, spec: str) -> str:
    """``spec`` applied to a finite number; 'n/a' for NaN (a metric the runs never logged)."""
    return spec.format(x) if math.isfinite(x) else "n/a"


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
        m, e = _mean_se([p[x] for p in points if x in p])
        mean.append(m)
        se.append(0.0 if math.isnan(e) else e)
    return xs, mean, se


def _series(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
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


def _trace_series(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """``_series`` over optimizer steps (``trace_points``): mean and standard error over seeds at each step."""
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


WITHIN_KEYS = [("ess", "ESS", "{:.3f}"), ("grpo_zeroed_0.2", "GRPO ε=0.2 zeroes", "{:.1%}"),
               ("kl_weight", "KL weight", "{:.3f}"), ("grad_norm", "gradient norm", "{:.2f}")]


def _within_round_lines(arms: dict[str, list[dict]]) -> list[str]:
    """Markdown lines: each multi-step arm's per-step means within a round (``within_round``)."""
    lines = []
    for arm, runs in arms.items():
        parts = []
        for key, label, fmt in WITHIN_KEYS:
            js, mean, _ = within_round(runs, key)
            if len(js) > 1:  # values listed in step order; the index is named only where a step is missing
                plain = js == list(range(1, len(js) + 1))
                parts.append(f"{label} " + ", ".join(fmt.format(m) if plain else f"{j}: {fmt.format(m)}"
                                                     for j, m in zip(js, mean)))
        if parts:
            lines.append(f"- {arm}: " + "; ".join(parts))
    if not lines:
        return []
    return ["**Within a round**, by optimizer step 1, 2, … of the round (mean over rounds, then over seeds):", "",
            *lines, ""]


def _smooth(xs: list[float], w: int = 5) -> list[float]:
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


# Colours a figure is reduced to: the plots draw at most 8 series colours plus their anti-aliased edges, and a
# 64-colour palette PNG is about a quarter of matplotlib's RGBA one (issue 38 item 5: committed reports stay small).
PALETTE = 64


def _save(fig, out: Path, fname: str) -> str:
    """Lay out, write ``out/fname`` as a ``PALETTE``-colour PNG and free ``fig``; returns ``fname`` for the Markdown link."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    Image.open(buf).convert("RGB").quantize(PALETTE).save(out / fname, optimize=True)
    return fname


def _figures(name: str, arms: dict[str, list[dict]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    panels = [
        ("curves", [("reward_mean", "training reward (5-step mean)", True), ("heldout_accuracy", "held-out pass@1", False)]),
        ("traces", [("ess", "normalized ESS of π/μ", False), ("cap_fraction", "P3O cap share (tokens)", False),
                    ("cap_weight_removed", "P3O cap: share of |A|·ρ removed", False),
                    ("kl_weight", "P3O KL weight", False), ("grpo_zeroed_0.2", "share GRPO(ε=0.2) would zero", False),
                    ("grad_norm", "gradient norm", False), ("staleness_mean", "mean sample age (versions)", False)]),
    ]
    for tag, keys in panels:
        fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * min(len(keys), 3), 3.0) if len(keys) < 4 else (2.4 * len(keys), 3.0), dpi=80)
        for ax, (key, label, smooth) in zip(axes, keys):
            for i, (arm, runs) in enumerate(arms.items()):
                steps, mean, se = (_trace_series if tag == "traces" else _series)(runs, key)
                if not steps:
                    continue
                if smooth:
                    mean, se = _smooth(mean), _smooth(se)
                c = COLORS[i % len(COLORS)]
                ax.plot(steps, mean, color=c, label=arm, lw=1.0 if tag == "traces" else 1.4,
                        marker="o" if key.startswith("heldout") else None, ms=3)
                ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], color=c, alpha=0.2)
            ax.set_xlabel("optimizer step" if tag == "traces" else "rollout round")
            ax.set_title(label, fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{name}: mean ± s.e. over seeds", fontsize=9)
        files.append(_save(fig, out, f"{name}_{tag}.png"))
    # token log-ratio histograms at the first and the last recorded round, summed over seeds
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.0), dpi=80)
    for ax, pick, title in ((axes[0], min, "first round"), (axes[1], max, "last round")):
        for i, (arm, runs) in enumerate(arms.items()):
            recs = [r for run in runs for r in run["ratios"] if "opt_step" not in r]
            if not recs:
                continue
            step = pick(r["step"] for r in recs)
            chosen = [r for r in recs if r["step"] == step]
            counts = [sum(c) for c in zip(*(r["counts"] for r in chosen))]
            edges = chosen[0]["edges"]
            total = sum(counts) or 1
            ax.step(edges[:-1], [c / total for c in counts], where="post", color=COLORS[i % len(COLORS)], label=arm, lw=1.2)
        ax.set_yscale("log")
        ax.set_xlabel("log π_θ/μ per token (clamped to ±2)")
        ax.set_title(f"ratio histogram, {title}", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    files.append(_save(fig, out, f"{name}_ratios.png"))
    step_fig = _step_ratio_figure(name, arms, out)
    within_fig = _within_round_figure(name, arms, out)
    return files + [f for f in (step_fig, within_fig) if f]


def _within_round_figure(name: str, arms: dict[str, list[dict]], out: Path) -> str | None:
    """ESS, clip share, KL weight and gradient norm against the step index within a round, for multi-step arms."""
    import matplotlib.pyplot as plt

    multi = {arm: runs for arm, runs in arms.items() if len(within_round(runs, "ess")[0]) > 1}
    if not multi:
        return None
    fig, axes = plt.subplots(1, len(WITHIN_KEYS), figsize=(2.6 * len(WITHIN_KEYS), 3.0), dpi=80)
    for ax, (key, label, _) in zip(axes, WITHIN_KEYS):
        for i, (arm, runs) in enumerate(arms.items()):
            if arm not in multi:
                continue
            js, mean, se = within_round(runs, key)
            c = COLORS[i % len(COLORS)]
            ax.errorbar(js, mean, yerr=se, color=c, label=arm, marker="o", ms=3, lw=1.2, capsize=2)
        ax.set_xlabel("optimizer step within the round")
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: within a round, mean over rounds, ± s.e. over seeds", fontsize=9)
    return _save(fig, out, f"{name}_within_round.png")


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


def _step_histograms(arms: dict[str, list[dict]]) -> dict[str, tuple[list[float], dict[int, list[int]]]]:
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


def _step_ratio_line(arms: dict[str, list[dict]]) -> str:
    """One sentence per replayed arm: median and 5–95% spread of log π_θ/μ at the round's first and last
    optimizer step; empty when no arm takes more than one optimizer step per round.

    Where every record of the step holds exact quantiles (``ratios.jsonl`` ``quantiles``), each is the median
    over recorded rounds and seeds of that mini-batch's exact quantile. Older records have only the 0.05-wide
    histogram: the pooled quantiles come from it, and the sentence says they cannot resolve |log ρ| < 0.05
    (an on-policy step's ratios, all within 1e-6 of 0, read as about ±0.04 there)."""
    parts, coarse = [], False
    for arm, (edges, by_step) in _step_histograms(arms).items():
        first, last = min(by_step), max(by_step)
        exact = _step_exact_quantiles(arms[arm])

        def spread(j: int) -> str:
            nonlocal coarse
            if j in exact:
                lo, med, hi = exact[j]
            else:
                coarse = True
                lo, med, hi = (histogram_quantile(edges, by_step[j], q) for q in (0.05, 0.5, 0.95))
            return f"{med:+.3f} [{lo:+.3f}, {hi:+.3f}]"

        parts.append(f"{arm}: {spread(first)} at step {first} → {spread(last)} at step {last}")
    if not parts:
        return ""
    how = ("from the pooled 0.05-wide histograms, which cannot resolve |log ρ| < 0.05: an on-policy step reads "
           "as about ±0.04" if coarse else
           "each the median over recorded rounds and seeds of that mini-batch's exact quantile")
    return ("Ratios of a replayed round (median [5%, 95%] of log π_θ/μ over the tokens each optimizer step trains on, "
            f"before that step; {how}): " + "; ".join(parts) + ".")


def _step_exact_quantiles(runs: list[dict]) -> dict[int, tuple[float, float, float]]:
    """{optimizer step within the round: (5%, 50%, 95%)}, each the median over the step's records of their
    exact quantile, for the steps whose every record has them."""
    import statistics

    by_step: dict[int, list[dict]] = {}
    for r in (r for run in runs for r in run["ratios"] if "opt_step" in r):
        by_step.setdefault(r["opt_step"], []).append(r)
    return {j: tuple(statistics.median(r["quantiles"][q] for r in recs) for q in ("0.05", "0.5", "0.95"))
            for j, recs in by_step.items() if all("quantiles" in r for r in recs)}


def _step_ratio_figure(name: str, arms: dict[str, list[dict]], out: Path) -> str | None:
    """Replayed rounds: the spread of log π_θ/μ over each optimizer step's mini-batch, against the step's index
    within its round (records of every recorded round and seed pooled), one line per arm; None when no arm
    takes more than one optimizer step per round."""
    import matplotlib.pyplot as plt

    per_arm = _step_histograms(arms)
    if not per_arm:
        return None
    fig, ax = plt.subplots(1, 1, figsize=(6.5, 3.2), dpi=80)
    for i, (arm, (edges, by_step)) in enumerate(per_arm.items()):
        xs = list(by_step)
        q = {p: [histogram_quantile(edges, by_step[x], p) for x in xs] for p in (0.05, 0.5, 0.95)}
        c = COLORS[list(arms).index(arm) % len(COLORS)]
        ax.plot(xs, q[0.5], color=c, marker="o", ms=3, lw=1.2, label=arm)
        ax.fill_between(xs, q[0.05], q[0.95], color=c, alpha=0.15)
    ax.set_xlabel("optimizer step within the round (0 = on the fresh batch)")
    ax.set_ylabel("log π_θ/μ per token")
    ax.set_title(f"{name}: median and 5–95% of the ratios each optimizer step trains on", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, f"{name}_step_ratios.png")


def _over_steps(runs: list[dict], key: str) -> float:
    """Mean over seeds of each run's mean of ``key`` over its optimizer steps (nan when never logged)."""
    return _mean_se([sum(v) / len(v) for run in runs
                     if (v := [r[key] for r in run["metrics"] if key in r and r["step"] > 0])])[0]


def run_scores(run: dict) -> tuple[list[tuple[int, float]], list[float]]:
    """(held-out evaluations as (round, pass@1), training reward per round) of one run."""
    evals = [(r["step"], r["heldout_accuracy"]) for r in run["metrics"] if "heldout_accuracy" in r]
    rewards = [r["reward_mean"] for r in run["metrics"] if r["step"] > 0 and "reward_mean" in r]
    return evals, rewards


def arm_scores(runs: list[dict]) -> tuple[dict[int, float], dict[int, str | None], dict[int, float]]:
    """({seed: primary score}, {seed: collapse reason or None}, {seed: base pass@1}) for one arm's runs."""
    scores, collapses, bases = {}, {}, {}
    for run in runs:
        evals, rewards = run_scores(run)
        try:
            scores[run["seed"]] = primary_score(evals)
            collapses[run["seed"]] = collapse_reason(evals, rewards)
        except ValueError:
            continue  # too few evaluations: reported as missing, not scored
        bases[run["seed"]] = next((v for s, v in evals if s == 0), float("nan"))
    return scores, collapses, bases


def _dose_figure(name: str, scored: dict[str, tuple[dict, dict, dict]], out: Path) -> str | None:
    """Primary score and collapses against shift strength, one line per objective family."""
    doses: list[str] = []
    fams: dict[str, dict[str, tuple[float, float, int, int]]] = {}
    ref = None
    for arm, (sc, col, _) in scored.items():
        fam, dose = family_and_dose(arm)
        m, se = _mean_se(list(sc.values()))
        n_col = sum(1 for v in col.values() if v)
        if dose is None:
            ref = (fam, m, se)
            continue
        if dose not in doses:
            doses.append(dose)
        fams.setdefault(fam, {})[dose] = (m, se, n_col, len(col))
    if not doses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    x = {d: i for i, d in enumerate(doses)}
    for i, (fam, pts) in enumerate(fams.items()):
        c = COLORS[i % len(COLORS)]
        ds = [d for d in doses if d in pts]
        axes[0].errorbar([x[d] + 0.04 * i for d in ds], [pts[d][0] for d in ds], yerr=[pts[d][1] for d in ds],
                         color=c, marker="o", ms=4, capsize=3, label=fam)
        axes[1].plot([x[d] + 0.04 * i for d in ds], [pts[d][2] / max(1, pts[d][3]) for d in ds], color=c, marker="o", ms=4, label=fam)
    if ref is not None and math.isfinite(ref[1]):
        axes[0].axhline(ref[1], color="k", ls="--", lw=1, label=f"{ref[0]} (no shift)")
    for ax, title in ((axes[0], "primary score (held-out pass@1, mean of last two evals) ± s.e."),
                      (axes[1], "fraction of seeds collapsed")):
        ax.set_xticks(range(len(doses)), doses, fontsize=8)
        ax.set_xlabel("shift strength")
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: dose–response", fontsize=9)
    return _save(fig, out, f"{name}_dose.png")


PREFLIGHT_COLUMNS = [("shift", "shift", "{}"), ("age", "age", "{}"), ("ess", "ESS", "{:.4f}"),
                     ("abs_log_ratio", "mean abs log ρ", "{:.1e}"),
                     ("zeroed@0.2", "zeroed ε=0.2", "{:.1%}"), ("zeroed@0.4", "zeroed ε=0.4", "{:.1%}"),
                     ("cos@0.2", "cos ε=0.2", "{:.3f}"), ("cos@0.4", "cos ε=0.4", "{:.3f}"), ("verdict", "verdict", "{}")]


def _read_preflight(exp_dir: Path) -> tuple[dict, list[dict], set[str] | None]:
    """(``preflight.json`` as a dict, its per-arm rows, the experiment's pre-flight-only arms or None when the folder
    has no ``experiment.yaml``). An old pre-flight file that is a bare list of rows reads as ``{}`` and those rows."""
    data = json.loads((exp_dir / "preflight.json").read_text())
    rows = data.get("arms", []) if isinstance(data, dict) else data
    spec_file = exp_dir / "experiment.yaml"
    only = set((yaml.safe_load(spec_file.read_text()) or {}).get("preflight_only") or []) if spec_file.exists() else None
    return (data if isinstance(data, dict) else {}), rows, only


def _preflight_table(exp_dir: Path) -> list[str]:
    """The pre-flight table (``trustbatch lab preflight``), if it was run into this experiment's folder."""
    if not (exp_dir / "preflight.json").exists():
        return ["No pre-flight was recorded for this experiment (`trustbatch lab preflight` writes `preflight.json`).", ""]
    data, rows, only = _read_preflight(exp_dir)
    if not rows:
        return []
    seeds = data.get("seeds")
    only = only or set()
    lines = [f"**Pre-flight at the base policy** (one batch per arm and seed{f', seeds {seeds}' if seeds else ''}, "
             "means over seeds; zeroed: share of tokens GRPO's clip zeroes; cos: P3O's gradient against GRPO(ε)'s on "
             "the same batch; "
             f"{data.get('control_rule', '')}):", "",
             "| arm | " + " | ".join(h for _, h, _ in PREFLIGHT_COLUMNS) + " |", "|---" * (len(PREFLIGHT_COLUMNS) + 1) + "|"]
    for r in rows:
        cells = []
        for k, _, fmt in PREFLIGHT_COLUMNS:
            v = r.get(k)
            cells.append("n/a" if v is None else fmt.format(v))
        mark = " (pre-flight only: not in the full run)" if r.get("arm") in only else ""
        lines.append(f"| {r.get('arm')}{mark} | " + " | ".join(cells) + " |")
    for sk in data.get("skipped") or []:
        lines.append(f"\nSkipped: {sk}")
    return lines + [""]


def preflight_summary(runs: Path) -> list[str]:
    """Markdown lines: every pre-flight under ``runs`` in one table, which the report puts first (issue 14, item 1).

    One row per experiment and arm, from each ``EXPERIMENT/preflight.json``, including the folders that hold only
    a pre-flight (a dose ladder probed and not run in full, such as bf16 / fp16 / int8 rollouts). "Full run" says
    whether the arm was trained: yes, no (pre-flight only: a control, or left out for time), or "no full run" for a
    folder without ``experiment.yaml``. Empty when no experiment has a pre-flight.
    """
    columns = [c for c in PREFLIGHT_COLUMNS if c[0] not in ("shift", "age", "abs_log_ratio")]
    rows = []
    for exp_dir in sorted(p for p in runs.iterdir() if (p / "preflight.json").exists()):
        _, arms, only = _read_preflight(exp_dir)
        for r in arms:
            full = "no full run" if only is None else ("no (pre-flight only)" if r.get("arm") in only else "yes")
            cells = ["n/a" if r.get(k) is None else fmt.format(r.get(k)) for k, _, fmt in columns]
            rows.append(f"| {exp_dir.name} | {r.get('arm')} | {r.get('age', 'n/a')} | " + " | ".join(cells) + f" | {full} |")
    if not rows:
        return []
    heads = [h for _, h, _ in columns]
    return ["## Pre-flight: which arms are tests", "",
            "At the base policy, one batch per arm and seed (the seeds each pre-flight names in its section), means over "
            "seeds. Zeroed: share of tokens GRPO's clip at ε zeroes; cos: P3O's gradient against GRPO(ε)'s on the same "
            "batch; age: optimizer steps since sampling. An arm is a **control** (no difference expected) when cos > "
            f"{CONTROL_COSINE} and zeroed < {CONTROL_ZEROED:.0%} at every ε and every seed, else a **test**.", "",
            "| experiment | arm | age | " + " | ".join(heads) + " | full run |", "|---" * (len(heads) + 4) + "|",
            *rows, ""]


def _round0_score(metrics) -> float | None:
    """The held-out pass@1 at round 0 (the base, before any update) from an iterable of records, read only up to
    the first held-out record; None when the run has no finite one."""
    first = next((r for r in metrics if "heldout_accuracy" in r), None)
    if first is None or first.get("step") != 0 or not isinstance(first["heldout_accuracy"], (int, float)):
        return None
    return first["heldout_accuracy"] if math.isfinite(first["heldout_accuracy"]) else None


def base_fingerprints(exp_dir: Path) -> dict[int, dict[str, float]]:
    """{seed: {arm: held-out pass@1 at round 0}} for every finished run under ``exp_dir`` (arm folders ``*/seedN``,
    tuning seeds included; other folders ignored): each run's base fingerprint.

    Round 0 is the base policy scored before any update, with the evaluation's own seed, so two runs from the same
    base weights score exactly alike. A different score therefore means a different base (rebuilt on another
    machine or with other packages) or a different evaluation; an equal score does not prove equal weights. A run
    without a finite round-0 score has no fingerprint. Reads each ``metrics.jsonl`` through ``lab.records`` (a file
    or a member of the experiment's ``runs.tar.xz``).
    """
    out: dict[int, dict[str, float]] = {}
    for run in records.finished_runs(exp_dir):
        seed = run.name.removeprefix("seed")
        if seed.isdigit() and records.exists(run / "metrics.jsonl"):
            if (v := _round0_score(records.read_jsonl(run / "metrics.jsonl"))) is not None:
                out.setdefault(int(seed), {})[run.parent.name] = v
    return out


def mixed_bases(prints: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """The seeds of ``base_fingerprints`` whose arms do not all share one base score (their pairing is broken)."""
    return {s: arms for s, arms in prints.items() if len(set(arms.values())) > 1}


def base_sets(prints: dict[str, dict[int, dict[str, float]]]) -> dict[str, str]:
    """{experiment: base-set label "A", "B", ...} in one greedy pass over ``prints`` in order.

    Each label keeps the union of its members' {seed: base score}. An experiment joins the first label with which
    it shares at least one seed and agrees at every shared seed; otherwise it opens a new label. So two
    experiments with one label agree wherever each agrees with the label's union, and an experiment that shares
    no seed with any label gets its own. An experiment with mixed bases (``mixed_bases``) is labelled "mixed".
    Runs pair across experiments only within one label."""
    groups: list[tuple[str, dict[int, float]]] = []
    labels: dict[str, str] = {}
    for name, per_seed in prints.items():
        if not per_seed:
            continue
        if mixed_bases(per_seed):
            labels[name] = "mixed"
            continue
        seeds = {s: next(iter(arms.values())) for s, arms in per_seed.items()}
        for label, known in groups:
            shared = seeds.keys() & known.keys()
            if shared and all(seeds[s] == known[s] for s in shared):
                known.update(seeds)
                labels[name] = label
                break
        else:
            label = chr(ord("A") + len(groups)) if len(groups) < 26 else f"set{len(groups) + 1}"
            groups.append((label, dict(seeds)))
            labels[name] = label
    return labels


def base_table(prints: dict[str, dict[int, dict[str, float]]]) -> list[str]:
    """Markdown lines: which experiments ran on which bases (``base_sets``), with each seed's base pass@1."""
    labels = base_sets(prints)
    if not labels:
        return []
    lines = ["## Bases: which experiments share them", "",
             "Each run scores its base before the first update (round 0, same evaluation seed), which fingerprints the "
             "base: equal scores at a seed mean the same base, as far as the score can tell; different scores mean the "
             "base was rebuilt differently (another machine or package versions) or evaluated differently. Arms are "
             "paired within an experiment; numbers from experiments with different labels are not paired.", "",
             "| experiment | bases | base pass@1 by seed |", "|---|---|---|"]
    for name, label in labels.items():
        per_seed = prints[name]
        cells = ", ".join(f"{s}: " + "/".join(f"{v:.4f}" for v in sorted(set(arms.values())))
                          for s, arms in sorted(per_seed.items()))
        lines.append(f"| {name} | {label} | {cells} |")
    return lines + [""]


def _mixed_line(mixed: dict[int, dict[str, float]]) -> str:
    """A report line naming the arms whose bases differ at each mixed seed."""
    parts = [f"seed {s}: " + ", ".join(f"{a} {v:.4f}" for a, v in sorted(arms.items()))
             for s, arms in sorted(mixed.items())]
    return ("**Mixed bases:** arms of this experiment started from bases that score differently at round 0, so "
            "their pairing at these seeds compares different bases (" + "; ".join(parts) + ").")


def descends(commit: str, ancestor: str) -> bool | None:
    """Whether ``commit`` is ``ancestor`` or descends from it in this checkout's git history; None when git cannot
    say (no git, no history, an unknown commit)."""
    try:
        r = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], capture_output=True,
                           cwd=Path(__file__).parent)
    except OSError:
        return None
    return {0: True, 1: False}.get(r.returncode)


def _registration(registered: str | None, calls: list[dict]) -> tuple[str | None, bool]:
    """(the report's line on a registered design, whether the rules of ``POST_HOC_RULE`` and ``EQUIVALENCE_RULE``
    were fixed before it). No line and False for an experiment without ``registered``."""
    if not registered:
        return None, False
    commits = sorted({str(c["commit"]) for c in calls if "start" in c and "commit" in c})
    later = {c: descends(c, registered) for c in commits}
    if not commits:
        check = "no `lab run` call recorded yet"
    elif all(later.values()):
        check = f"every `lab run` call's commit ({', '.join(f'`{c}`' for c in commits)}) descends from it"
    elif any(v is False for v in later.values()):
        check = ("**not before every run**: the calls at " + ", ".join(f"`{c}`" for c, v in later.items() if v is False)
                 + " do not descend from it")
    else:
        check = "git could not check the calls' commits against it here"
    rules_before = all(descends(registered, r) for r in (POST_HOC_RULE, EQUIVALENCE_RULE))
    return f"**Registered** at `{registered}` before any run: {check}.", rules_before


def _calls_line(calls: list[dict]) -> str:
    """One sentence per ``lab run`` call (``lab.calls``): its seeds, commit, command, start and length."""
    parts = []
    if any("legacy_wall_s" in c for c in calls):
        parts.append(f"earlier calls, recorded only as their summed time ({sum(c.get('legacy_wall_s', 0) for c in calls) / 60:.1f} min)")
    for c in calls:
        if "start" not in c:
            continue
        seeds = c.get("seeds", []) + c.get("tune_seeds", [])
        parts.append(f"seeds {seeds} at commit `{c.get('commit', 'unknown')}` (`{c.get('command', '')}`, started "
                     f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(c['start']))}, {(c['end'] - c['start']) / 60:.1f} min, {c.get('runs_started', '?')} runs"
                     + (", interrupted" if c.get("interrupted") else "") + (f"; {c['note']}" if c.get("note") else "") + ")")
    return f"Ran in {len(parts)} call{'s' * (len(parts) != 1)}: " + "; ".join(parts) + "."


def _wall_and_builds(exp_dir: Path, calls: list[dict]) -> tuple[float | None, float | None]:
    """(wall-clock seconds, base-build seconds) of an experiment: the time its ``calls.jsonl`` records cover
    (overlaps counted once), else its ``wall_s.txt``, else None; builds as the timed calls recorded them, else None."""
    timed = [c for c in calls if "start" in c]
    wall = elapsed_seconds(calls) if calls else (float((exp_dir / WALL).read_text()) if (exp_dir / WALL).exists() else None)
    return wall, (sum(float(c.get("build_s", 0.0)) for c in timed) if timed else None)


def _experiment_time(exp_dir: Path, calls: list[dict]) -> str:
    """'; the whole experiment took …' from the ``calls.jsonl`` records (overlaps counted once), else ``wall_s.txt``."""
    wall, build = _wall_and_builds(exp_dir, calls)
    if build is not None:
        timed = [(c["start"], c["end"]) for c in calls if "start" in c]
        overlap = sum(e - s for s, e in timed) - covered_seconds(timed)
        return (f"; the whole experiment took {wall / 60:.1f} min wall-clock on 2 cores"
                f" (base builds {build / 60:.1f} min of it"
                + (f"; calls overlapped for {overlap / 60:.1f} min, counted once" if overlap > 1 else "") + ").")
    if wall is not None:
        return f"; the whole experiment took {wall / 60:.1f} min wall-clock on 2 cores."
    return "."


def _run_config(path: Path) -> dict:
    """A run's resolved config (``ARM/seedK.yaml``, a file or packed), parsed with libyaml where PyYAML has it: the
    report reads two per run, hundreds in all, and the pure-Python parser spent most of the report's time on them."""
    return yaml.load(records.read_text(path), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


def _reused(exp_dir: Path, arm_dir: Path, run_name: str) -> bool | None:
    """Whether a run was trained in another experiment's folder and copied or linked here (an ``onpolicy``
    reference): its resolved config's ``run_dir`` names another experiment (``.../EXPERIMENT/ARM/seedK``).
    None when the run has no config beside it (``ARM/seedK.yaml``), so its origin is unknown."""
    cfg = arm_dir / f"{run_name}.yaml"
    if not records.exists(cfg):
        return None
    run_dir = _run_config(cfg).get("run_dir")
    parts = Path(str(run_dir)).parts if run_dir else ()
    return len(parts) >= 3 and parts[-3] != exp_dir.name


def experiment_cost(exp_dir: Path) -> dict | None:
    """What one experiment cost, from its folder: None when it has no finished run.

    Returns a dict:
        own: runs trained in this folder; reused: runs trained in another experiment's folder
            (``reused_s``: their summed one-thread seconds, not part of this experiment's time);
            unknown: runs without a config beside them (origin unknown).
        wall_s: wall-clock seconds covered by its ``lab run`` calls (``calls.elapsed_seconds``), or its
            ``wall_s.txt`` for an experiment run before ``calls.jsonl``; None when neither exists.
        build_s: base-build seconds the calls recorded, None when no call recorded them;
            ``builds_partial``: some of the time comes from calls that did not record their builds.
        run_s: (shortest, longest) one-thread seconds of its own runs, or None.
    """
    exp_dir = Path(exp_dir)
    own: list[float] = []
    reused, reused_s, unknown = 0, 0.0, 0
    for run in records.finished_runs(exp_dir):
        wall = float(json.loads(records.read_text(run / "summary.json")).get("wall_s") or 0.0)
        origin = _reused(exp_dir, run.parent, run.name)
        if origin is None:
            unknown += 1
        elif origin:
            reused, reused_s = reused + 1, reused_s + wall
        else:
            own.append(wall)
    if not own and not reused and not unknown:
        return None
    calls = load_calls(exp_dir)
    wall_s, build_s = _wall_and_builds(exp_dir, calls)
    return {"own": len(own), "reused": reused, "reused_s": reused_s, "unknown": unknown, "wall_s": wall_s,
            "build_s": build_s, "builds_partial": build_s is not None and any("legacy_wall_s" in c for c in calls),
            "run_s": (min(own), max(own)) if own else None}


def cost_table(costs: dict[str, dict | None]) -> list[str]:
    """Markdown lines: each experiment's measured wall-clock against ``BUDGET_MIN`` (``experiment_cost``)."""
    lines = [f"## Cost against the {BUDGET_MIN:.0f}-minute budget", "",
             "Wall-clock covered by each experiment's `trustbatch lab run` calls on the 2-core machine (overlapping "
             "calls counted once; other work shared the cores during some calls, which the lab notes say). Base builds "
             "run inside a call and count in its time; the column shows them where the calls recorded them. Reused "
             "runs: runs whose resolved config names another experiment's run folder (an on-policy reference "
             "copied or linked here); they are not counted in the wall-clock, and their one-thread time is shown.", "",
             "| experiment | runs trained | reused runs (one-thread time) | wall-clock | of it base builds | one run (one thread) | within budget |",
             "|---|---|---|---|---|---|---|"]
    for name, c in costs.items():
        if c is None:
            continue
        trained = f"{c['own']}" + (f" (+{c['unknown']} of unknown origin: no config)" if c["unknown"] else "")
        reused = f"{c['reused']} ({c['reused_s'] / 60:.1f} min)" if c["reused"] else "0"
        runs = f"{c['run_s'][0] / 60:.1f}–{c['run_s'][1] / 60:.1f} min" if c["run_s"] else "n/a"
        builds = "not recorded" if c["build_s"] is None else (
            f"{c['build_s'] / 60:.1f} min" + (" (earlier calls: not recorded)" if c["builds_partial"] else ""))
        if c["wall_s"] is None:
            wall, verdict = "not recorded", "not measured"
        else:
            wall = f"{c['wall_s'] / 60:.1f} min"
            over = c["wall_s"] / 60 - BUDGET_MIN
            verdict = "yes" if over <= 0 else f"**no** ({over:.1f} min over)"
        lines.append(f"| {name} | {trained} | {reused} | {wall} | {builds} | {runs} | {verdict} |")
    return lines + [""]


def _prompts_per_round(exp_dir: Path, arms: dict[str, list[dict]]) -> str:
    """' × N prompts' from the runs' own configs (an experiment run before LAB_COMMON changed keeps its own)."""
    sizes = set()
    for arm, runs in arms.items():
        for run in runs:
            f = exp_dir / arm / f"seed{run['seed']}.yaml"
            if records.exists(f):
                sizes.add(_run_config(f).get("rollout", {}).get("prompts_per_step"))
    sizes.discard(None)
    return f" × {'/'.join(str(x) for x in sorted(sizes))} prompts" if sizes else ""


def experiment_section(name: str, exp_dir: Path, out: Path) -> tuple[str, list[str]]:
    """Markdown for one experiment and its one-line findings (rules in ``trustbatch.lab.stats``)."""
    spec = yaml.safe_load((exp_dir / "experiment.yaml").read_text()) if (exp_dir / "experiment.yaml").exists() else {}
    tune = (spec or {}).get("tune") or {}
    tune_seeds = [int(x) for x in tune.get("seeds") or []]
    # runs on the tuning seeds only pick the tuned baseline; every table, figure and comparison uses the others
    tuning: dict[str, list[dict]] = {}
    arms: dict[str, list[dict]] = {}
    for arm, runs in load_runs(exp_dir).items():
        for run in runs:
            (tuning if run["seed"] in tune_seeds else arms).setdefault(arm, []).append(run)
    if not arms:
        return "\n".join([f"## {name}", "", f"No finished runs in `{exp_dir}`.", ""] + _preflight_table(exp_dir)), []
    figs = _figures(name, arms, out)
    scored = {arm: arm_scores(runs) for arm, runs in arms.items()}
    dose_fig = _dose_figure(name, scored, out)
    lines = [f"## {name}", "", spec.get("description", ""), ""]
    calls = load_calls(exp_dir)
    if any("start" in c for c in calls):
        lines += [_calls_line(calls), ""]
    elif spec.get("command"):
        lines += [f"Ran `{spec['command']}` at commit `{spec.get('commit', 'unknown')}`.", ""]
    rerun = reproduced_line(exp_dir)
    lines += [rerun, ""] if rerun else []
    registration, rules_before = _registration(spec.get("registered"), calls)
    lines += [registration, ""] if registration else []
    wall = [run["summary"]["wall_s"] for runs in arms.values() for run in runs]
    seeds = sorted({run["seed"] for runs in arms.values() for run in runs})
    n_tuning = sum(len(r) for a, r in tuning.items() if a in (tune.get("arms") or []))
    lines.append(f"Seeds {seeds} ({'each with its own SFT base' if spec.get('per_seed_base', True) else 'one shared base'}); "
                 f"{len(wall)} runs{f' (and {n_tuning} tuning runs on seeds {tune_seeds})' if n_tuning else ''} of {max(len(r['metrics']) - 1 for runs in arms.values() for r in runs)} rounds"
                 f"{_prompts_per_round(exp_dir, arms)}; "
                 f"one run took {min(wall) / 60:.1f}–{max(wall) / 60:.1f} min on one CPU thread"
                 + _experiment_time(exp_dir, calls))
    lines += [""] + _preflight_table(exp_dir)
    # the compared runs' base scores, as arm_scores took them (tuning seeds are never paired)
    base_by_seed: dict[int, dict[str, float]] = {}
    for arm, (_, _, bases) in scored.items():
        for seed, v in bases.items():
            if math.isfinite(v):
                base_by_seed.setdefault(seed, {})[arm] = v
    mixed = mixed_bases(base_by_seed)
    lines += [_mixed_line(mixed), ""] if mixed else []
    lines += ["| arm | base pass@1 | primary score | collapsed | mean ESS | min ESS | clip share | cap share | cap removes | mean grad norm |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    scores: dict[str, dict[int, float]] = {}
    collapse_lines = []
    for arm, runs in arms.items():
        sc, col, bases = scored[arm]
        scores[arm] = sc
        m, se = _mean_se(list(sc.values()))
        n_col = sum(1 for v in col.values() if v)
        min_ess = _mean_se([min((r["ess"] for r in run["metrics"] if "ess" in r), default=float("nan")) for run in runs])[0]
        lines.append(f"| {arm} | {_mean_se(list(bases.values()))[0]:.3f} | {m:.3f} ± {se:.3f} | {n_col}/{len(col)} "
                     f"| {_over_steps(runs, 'ess'):.4f} | {min_ess:.4f} | {_over_steps(runs, 'grpo_zeroed_0.2'):.3f} "
                     f"| {_fmt(_over_steps(runs, 'cap_fraction'), '{:.3f}')} | {_fmt(_over_steps(runs, 'cap_weight_removed'), '{:.2%}')} "
                     f"| {_over_steps(runs, 'grad_norm'):.3f} |")
        collapse_lines += [f"- {arm} seed {s}: {why}" for s, why in sorted(col.items()) if why]
    lines += ["", "Primary score: mean held-out pass@1 (T = 1) of the last two evaluations, ± one standard error over seeds. "
              "Collapsed: seeds meeting the collapse rule fixed before the runs (`trustbatch.lab.stats`). "
              "Clip share: the share of tokens GRPO's clip at ε = 0.2 would zero on the arm's own data, per optimizer step, whatever the arm's objective. "
              "Cap share: P3O's capped-token share. Cap removes: the share of P3O's score-function weight Σ|A|·ρ that "
              "its cap takes away (n/a for runs from before the metric existed, and for arms that are not P3O).", ""]
    lines += (["**Collapses:**", ""] + collapse_lines + [""]) if collapse_lines else ["**Collapses:** none.", ""]
    pairs = [tuple(c) for c in spec.get("compare") or []] or default_comparisons(list(arms))
    pairs = [(a, b) for a, b in pairs if a in scores and b in scores]
    tuned, tuned_lines = _tuned_baseline(tune, tuning)
    findings, equivalence = [], []
    for a, b in pairs:
        mark = f" ({tuned} is the tuned baseline)" if tuned in (a, b) else ""
        if broken := sorted(s for s, arms in mixed.items() if a in arms and b in arms and arms[a] != arms[b]):
            mark += f" (bases differ at seeds {broken}: not a clean pairing)"
        try:
            both = {s for s, why in scored[a][1].items() if why} & {s for s, why in scored[b][1].items() if why}
            result = paired_interval(a, b, scores[a], scores[b], comparisons=len(pairs), collapsed_both=both)
            note = None if rules_before else result.post_hoc_note()
            findings.append(result.sentence() + mark + (f"\n  - {note}" if note else ""))
            if not result.both_collapsed:  # scores at the floor: not a question of equivalence
                equivalence.append((tost(a, b, scores[a], scores[b], comparisons=len(pairs)), result.verdict() == "match"))
        except ValueError as e:
            findings.append(f"{a} vs {b}: not compared ({e}).{mark}")
    if tuned and not any(tuned in p for p in pairs):
        tuned_lines += [f"The tuned baseline {tuned} is in none of this experiment's comparisons.", ""]
    lines += tuned_lines
    lines += [f"**Findings** ({len(pairs)} paired comparisons of the primary score; Bonferroni over {len(pairs)}, "
              f"family-wise 95%; 'match' only within ±{MARGIN}):", ""] + [f"- {f}" for f in findings] + [""]
    lines += _equivalence_lines(equivalence, fixed_before=rules_before)
    step_line = _step_ratio_line(arms)
    lines += ([step_line, ""] if step_line else []) + _within_round_lines(arms) + [f"![{f}]({f})" for f in ([dose_fig] if dose_fig else []) + figs] + [""]
    return "\n".join(lines), [f"{name}: {f}" for f in findings]


def _equivalence_lines(results: list[tuple], fixed_before: bool = False) -> list[str]:
    """The experiment's resolvable margins and TOST lines from (``stats.tost`` result, whether the interval rule
    read 'match') pairs; [] without a comparison. A 'match' at a margin the design does not resolve is said to be
    no more than 'no difference found'. ``fixed_before``: the experiment was registered after the rule existed."""
    if not results:
        return []
    unresolved = (" The interval rule's 'match' above rests on a margin this design does not resolve: read it as 'no "
                  "difference found', not as equivalence.")
    lo, hi = min(r.resolvable for r, _ in results), max(r.resolvable for r, _ in results)
    span = f"±{lo:.3f}" if f"{lo:.3f}" == f"{hi:.3f}" else f"±{lo:.3f} to ±{hi:.3f}"
    when = "fixed before these runs" if fixed_before else "written after these runs: post hoc here"
    return [f"**Equivalence** (rule of `{EQUIVALENCE_RULE}`, {when}). The smallest margin "
            f"this design resolves: {span} across its comparisons (TOST at the family's level α/m with {POWER:.0%} power "
            f"at a true difference of 0, from each pair's paired SD and seeds). 'Equivalent within ±{MARGIN}' is tested "
            "only where ±" f"{MARGIN} is at or above a pair's resolvable margin:", ""] + [
        f"- {r.sentence()}" + (unresolved if matched and r.verdict() == "beyond the design" else "") for r, matched in results] + [""]


def _tuned_baseline(tune: dict, tuning: dict[str, list[dict]]) -> tuple[str | None, list[str]]:
    """(the tuned baseline's arm or None, report lines) from the runs on the tuning seeds (``stats.pick_tuned``)."""
    if not tune:
        return None, []
    grid, seeds = list(tune.get("arms") or []), [int(x) for x in tune.get("seeds") or []]
    try:
        pick, means = pick_tuned(grid, {a: arm_scores(runs)[0] for a, runs in tuning.items()}, seeds)
    except ValueError as e:
        return None, [f"**Tuned baseline:** not picked: {e}", ""]
    grid_text = ", ".join(f"{a} {m:.3f}" for a, m in means.items())
    return pick, [f"**Tuned baseline:** {pick}, the best of the grid by mean primary score on the tuning seeds {seeds} "
                  f"({grid_text}); those seeds take no part in the comparisons below.", ""]


def write_report(runs: Path, out: Path, experiments: list[str] | None = None) -> Path:
    """Write ``out/README.md`` and the figures for ``experiments`` (default: every experiment under ``runs``).

    Raises:
        UserError: ``runs`` holds no experiment.
    """
    if not runs.is_dir():
        raise UserError(f"no lab runs in {str(runs)!r}; run `trustbatch lab run EXPERIMENT --out {runs}` first")
    names = experiments or sorted(p.name for p in runs.iterdir() if (p / "experiment.yaml").exists())
    if not names:
        raise UserError(f"no experiments under {str(runs)!r}")
    out.mkdir(parents=True, exist_ok=True)
    sections, findings = [], []
    for n in names:
        if not (runs / n).is_dir():
            raise UserError(f"experiment {n!r} has no runs in {str(runs)!r}")
        text, f = experiment_section(n, runs / n, out)
        sections.append(text)
        findings += f
    head = [
        "# Off-policy lab report", "",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} from `{runs}` at commit `{git_commit()}` by "
        f"`trustbatch lab report {' '.join(experiments or [])}{' ' if experiments else ''}--runs {runs} --out {out}`.", "",
        "Every run is `trustbatch train` with the lab's common settings (`LAB_COMMON` in "
        f"`src/trustbatch/lab/experiment.py`: {LAB_COMMON['train.steps']} rounds × {LAB_COMMON['rollout.prompts_per_step']} prompts × 8 samples, "
        "(an experiment run before a change of these says its own prompts per round), "
        f"one optimizer step per round unless the arm says otherwise, held-out pass@1 from 256 prompts × "
        f"{LAB_COMMON['eval.samples_per_prompt']} samples every {LAB_COMMON['eval.every']} rounds), each seed with its own SFT base. "
        "Only the behaviour shift and the objective change between arms; nothing was tuned for any arm.", "",
        "The trace figures (`*_traces.png`) are drawn against the optimizer step. A run with several optimizer steps per "
        "round that has `steps.jsonl` shows every step; one from before that file existed "
        "shows its round means, each at the round's last step.", "",
        "The rules (`src/trustbatch/lab/stats.py`, each with the commit that introduced it) were fixed before the runs "
        "but one: the primary score is the mean of the last "
        "two held-out evaluations; a run collapses when its primary score is below half of its base or its training "
        "reward (10-round mean) ends below half of its peak; arms are compared by paired t-intervals over seeds "
        f"with a Bonferroni correction per experiment, and 'match' is claimed only inside ±{MARGIN}. The exception is "
        f"post hoc: 'both collapse' (`{POST_HOC_RULE}`), two arms that collapse in every common seed, was written after "
        "the first run in which every arm collapsed had been seen. Each verdict it decided is followed by what the "
        "rules fixed before the runs read (an experiment registered after the rule existed says so in its section). Each experiment's **Equivalence** lines (TOST, and the smallest margin its "
        f"design resolves; rule of `{EQUIVALENCE_RULE}`) were added after all these runs: post hoc, and they change "
        "no verdict.", "",
        *preflight_summary(runs),
        *base_table({n: base_fingerprints(runs / n) for n in names}),
        "## All findings", "",
        *[f"- {f}" for f in findings], "",
        *cost_table({n: experiment_cost(runs / n) for n in names}),
    ]
    path = out / "README.md"
    atomic_write(path, "\n".join(head + sections) + "\n")
    return path
