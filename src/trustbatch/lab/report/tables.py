"""The report's tables and lines: per-arm results, pre-flights, within-round and replayed-ratio lines, the
equivalence lines, the tuned baseline, the bases and the cost against the budget (Markdown lines from numbers that
``runs`` and ``provenance`` compute)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from ..preflight import CONTROL_COSINE, CONTROL_ZEROED
from ..stats import MARGIN, POWER, pick_tuned
from .provenance import base_sets
from .runs import (arm_scores, histogram_quantile, mean_se, over_steps, step_exact_quantiles, step_histograms,
                   within_round)


WITHIN_KEYS = [("ess", "ESS", "{:.3f}"), ("grpo_zeroed_0.2", "GRPO ε=0.2 zeroes", "{:.1%}"),
               ("kl_weight", "KL weight", "{:.3f}"), ("grad_norm", "gradient norm", "{:.2f}")]


def _fmt(x: float, spec: str) -> str:
    """``spec`` applied to a finite number; 'n/a' for NaN (a metric the runs never logged)."""
    return spec.format(x) if math.isfinite(x) else "n/a"


def arm_table(arms: dict[str, list[dict]], scored: dict[str, tuple[dict, dict, dict]]) -> list[str]:
    """Markdown lines: one row per arm (base pass@1, primary score ± s.e., collapses, ESS, clip and cap shares,
    gradient norm), the columns' legend and each collapsed seed with its reason; ``scored``: ``arm_scores`` by arm."""
    lines = ["| arm | base pass@1 | primary score | collapsed | mean ESS | min ESS | clip share | cap share | cap removes | mean grad norm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    collapse_lines = []
    for arm, runs in arms.items():
        sc, col, bases = scored[arm]
        m, se = mean_se(list(sc.values()))
        n_col = sum(1 for v in col.values() if v)
        min_ess = mean_se([min((r["ess"] for r in run["metrics"] if "ess" in r), default=float("nan")) for run in runs])[0]
        lines.append(f"| {arm} | {mean_se(list(bases.values()))[0]:.3f} | {m:.3f} ± {se:.3f} | {n_col}/{len(col)} "
                     f"| {over_steps(runs, 'ess'):.4f} | {min_ess:.4f} | {over_steps(runs, 'grpo_zeroed_0.2'):.3f} "
                     f"| {_fmt(over_steps(runs, 'cap_fraction'), '{:.3f}')} | {_fmt(over_steps(runs, 'cap_weight_removed'), '{:.2%}')} "
                     f"| {over_steps(runs, 'grad_norm'):.3f} |")
        collapse_lines += [f"- {arm} seed {s}: {why}" for s, why in sorted(col.items()) if why]
    lines += ["", "Primary score: mean held-out pass@1 (T = 1) of the last two evaluations, ± one standard error over seeds. "
              "Collapsed: seeds meeting the collapse rule fixed before the runs (`trustbatch.lab.stats`). "
              "Clip share: the share of tokens GRPO's clip at ε = 0.2 would zero on the arm's own data, per optimizer step, whatever the arm's objective. "
              "Cap share: P3O's capped-token share. Cap removes: the share of P3O's score-function weight Σ|A|·ρ that "
              "its cap takes away (n/a for runs from before the metric existed, and for arms that are not P3O).", ""]
    return lines + ((["**Collapses:**", ""] + collapse_lines + [""]) if collapse_lines else ["**Collapses:** none.", ""])


def within_round_lines(arms: dict[str, list[dict]]) -> list[str]:
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


def step_ratio_line(arms: dict[str, list[dict]]) -> str:
    """One sentence per replayed arm: median and 5–95% spread of log π_θ/μ at the round's first and last
    optimizer step; empty when no arm takes more than one optimizer step per round.

    Where every record of the step holds exact quantiles (``ratios.jsonl`` ``quantiles``), each is the median
    over recorded rounds and seeds of that mini-batch's exact quantile. Older records have only the 0.05-wide
    histogram: the pooled quantiles come from it, and the sentence says they cannot resolve |log ρ| < 0.05
    (an on-policy step's ratios, all within 1e-6 of 0, read as about ±0.04 there)."""
    parts, coarse = [], False
    for arm, (edges, by_step) in step_histograms(arms).items():
        first, last = min(by_step), max(by_step)
        exact = step_exact_quantiles(arms[arm])

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


def preflight_table(exp_dir: Path) -> list[str]:
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


def equivalence_lines(results: list[tuple], rule: str, label: str, margin: float = MARGIN) -> list[str]:
    """The experiment's resolvable margins and TOST lines from (``stats.tost`` result, whether the interval rule
    read 'match') pairs; [] without a comparison. A 'match' (always at ±``MARGIN``) where ``MARGIN`` is below the
    pair's resolvable margin is said to be no more than 'no difference found'. ``rule``: the rule's commit; ``label``: how it stands against these runs
    (``provenance.standing_label``: "fixed before these runs", "post hoc", ...); ``margin``: the experiment's TOST
    margin (``equivalence_margin``)."""
    if not results:
        return []
    unresolved = (" The interval rule's 'match' above rests on a margin this design does not resolve: read it as 'no "
                  "difference found', not as equivalence.")
    lo, hi = min(r.resolvable for r, _ in results), max(r.resolvable for r, _ in results)
    span = f"±{lo:.3f}" if f"{lo:.3f}" == f"{hi:.3f}" else f"±{lo:.3f} to ±{hi:.3f}"
    return [f"**Equivalence** (rule of `{rule}`, {label}). The smallest margin "
            f"this design resolves: {span} across its comparisons (TOST at the family's level α/m with {POWER:.0%} power "
            f"at a true difference of 0, from each pair's paired SD and seeds). 'Equivalent within ±{margin}' is tested "
            "only where ±" f"{margin} is at or above a pair's resolvable margin:", ""] + [
        # the interval rule's 'match' is read at ±MARGIN whatever the TOST margin: that margin must be resolved
        f"- {r.sentence()}" + (unresolved if matched and MARGIN < r.resolvable else "") for r, matched in results] + [""]


def tuned_baseline(tune: dict, tuning: dict[str, list[dict]]) -> tuple[str | None, list[str]]:
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


# Issue 14's budget: each experiment at most 40 minutes wall-clock on the 2-core machine.
BUDGET_MIN = 40.0


def cost_table(costs: dict[str, dict | None]) -> list[str]:
    """Markdown lines: each experiment's measured wall-clock against ``BUDGET_MIN`` (``experiment_cost``)."""
    lines = [f"## Cost against the {BUDGET_MIN:.0f}-minute budget", "",
             "Wall-clock covered by each experiment's `trustbatch lab run` calls on the 2-core machine (overlapping "
             "calls counted once; other work shared the cores during some calls, which the lab notes say). Base builds "
             "run inside a call and count in its time; the column shows them where the calls recorded them. A pre-flight (`trustbatch lab "
             "preflight`, which builds the bases it needs) runs outside the calls: its own column, where "
             "`preflight.json` recorded its time (older pre-flights did not: their time is in the lab's notes). Reused "
             "runs: runs whose resolved config names another experiment's run folder (an on-policy reference "
             "copied or linked here); they are not counted in the wall-clock, and their one-thread time is shown.", "",
             "| experiment | runs trained | reused runs (one-thread time) | wall-clock | of it base builds | pre-flight | one run (one thread) | within budget |",
             "|---|---|---|---|---|---|---|---|"]
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
        pre = "none" if c["preflight_s"] is False else ("not recorded" if c["preflight_s"] is None else f"{c['preflight_s'] / 60:.1f} min")
        lines.append(f"| {name} | {trained} | {reused} | {wall} | {builds} | {pre} | {runs} | {verdict} |")
    return lines + [""]
