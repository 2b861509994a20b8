"""One experiment's report section, and the whole report: the pieces of ``runs``, ``figures``, ``tables`` and
``provenance`` put in the report's reading order, with the comparisons' findings (rules of ``lab.stats``)."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path

from ...errors import UserError
from ...records import atomic_write
from ..calls import load_calls
from ..experiment import default_comparisons
from ..reproduce import reproduced_line
from ..stats import (BOTH_COLLAPSE_RULE, EQUIVALENCE_RULE, MARGIN, SENSITIVITY_RULE, interaction, paired_interval,
                     signed_rank, tost)
from .figures import dose_figure, experiment_figures
from .header import header_lines
from .provenance import (base_fingerprints, calls_line, experiment_cost, experiment_spec, experiment_time, git_commit,
                         mixed_bases, mixed_line, prompts_per_round, registered_seeds, registration_line, rule_standing,
                         run_commits, standing_label)
from .runs import arm_scores, load_runs, unscored
from .tables import (arm_table, base_table, cost_table, equivalence_lines, preflight_summary, preflight_table,
                     step_ratio_line, tuned_baseline, within_round_lines)


FIGURES = ("draw", "link", "none")


def experiment_section(name: str, exp_dir: Path, out: Path, *, figures: str = "draw") -> tuple[str, list[str]]:
    """Markdown for one experiment and its one-line findings (rules in ``trustbatch.lab.stats``); ``figures``: "draw"
    writes its figures into ``out`` and links them, "link" links them without drawing, "none" does neither."""
    spec, completed = experiment_spec(name, exp_dir)
    tune = spec.get("tune") or {}
    arms, tuning = _split_tuning(load_runs(exp_dir), [int(x) for x in tune.get("seeds") or []])
    if (allowed := registered_seeds(spec)) is not None:  # runs of seeds added after a registration: post hoc
        arms = {a: kept for a, runs in arms.items() if (kept := [r for r in runs if r["seed"] in allowed])}
    if not arms:
        return "\n".join([f"## {name}", "", f"No finished runs in `{exp_dir}`.", ""] + preflight_table(exp_dir)), []
    draw = figures == "draw"
    figs = experiment_figures(name, arms, out, draw=draw) if figures != "none" else []
    scored = {arm: arm_scores(runs) for arm, runs in arms.items()}
    dose_fig = dose_figure(name, scored, out, draw=draw) if figures != "none" else None
    lines = [f"## {name}", "", spec.get("description", ""), ""]
    calls = load_calls(exp_dir)
    head = _provenance_lines(spec, exp_dir, calls) + ([completed, ""] if completed else [])
    commits = run_commits(spec, calls)
    lines += head + [_runs_sentence(spec, exp_dir, calls, arms, tuning)]
    lines += [""] + preflight_table(exp_dir)
    mixed = mixed_bases(_compared_bases(scored))
    lines += [mixed_line(mixed), ""] if mixed else []
    lines += arm_table(arms, scored)
    if left_out := [f"{arm} seed {seed} ({why})" for arm, runs in arms.items() for seed, why in unscored(runs).items()]:
        lines += [f"Finished but not scored, so in no comparison: {'; '.join(left_out)}.", ""]
    # The family is what was registered (or, without a compare list, the defaults over every arm the experiment
    # runs), whatever finished: a pair of an arm without finished runs stays in it, "not compared", so that the
    # Bonferroni level never loosens because runs are missing.
    planned = [a for a in (spec.get("arms") or arms) if a not in (spec.get("preflight_only") or [])]
    pairs = [tuple(c) for c in spec.get("compare") or []] or default_comparisons(planned)
    tuned, tuned_lines = tuned_baseline(tune, tuning)
    margin = float(spec.get("equivalence_margin") or MARGIN)
    findings, equivalence = _comparisons(pairs, scored, mixed, tuned, rule_standing(BOTH_COLLAPSE_RULE, commits), margin)
    if tuned and not any(tuned in p for p in pairs):
        tuned_lines += [f"The tuned baseline {tuned} is in none of this experiment's comparisons.", ""]
    lines += tuned_lines
    lines += [f"**Findings** ({len(pairs)} paired comparisons of the primary score; Bonferroni over {len(pairs)}, "
              f"family-wise 95%; 'match' only within ±{MARGIN}):", ""] + [f"- {f}" for f in findings] + [""]
    lines += equivalence_lines(equivalence, EQUIVALENCE_RULE, standing_label(rule_standing(EQUIVALENCE_RULE, commits)), margin)
    lines += _secondary_lines(spec, pairs, scored, standing_label(rule_standing(SENSITIVITY_RULE, commits)))
    step_line = step_ratio_line(arms)
    lines += ([step_line, ""] if step_line else []) + within_round_lines(arms) + [f"![{f}]({f})" for f in ([dose_fig] if dose_fig else []) + figs] + [""]
    return "\n".join(lines), [f"{name}: {f}" for f in findings]


def _split_tuning(runs: dict[str, list[dict]], tune_seeds: list[int]) -> tuple[dict, dict]:
    """({arm: compared runs}, {arm: runs on the tuning seeds}) of ``load_runs``' result."""
    # runs on the tuning seeds only pick the tuned baseline; every table, figure and comparison uses the others
    tuning: dict[str, list[dict]] = {}
    arms: dict[str, list[dict]] = {}
    for arm, arm_runs in runs.items():
        for run in arm_runs:
            (tuning if run["seed"] in tune_seeds else arms).setdefault(arm, []).append(run)
    return arms, tuning


def _provenance_lines(spec: dict, exp_dir: Path, calls: list[dict]) -> list[str]:
    """The section's lines on how it ran: its calls or command, a re-run check, a registration."""
    lines = []
    if any("start" in c for c in calls):
        lines += [calls_line(calls), ""]
    elif spec.get("command"):
        lines += [f"Ran `{spec['command']}` at commit `{spec.get('commit', 'unknown')}`.", ""]
    rerun = reproduced_line(exp_dir)
    lines += [rerun, ""] if rerun else []
    registration = registration_line(spec.get("registered"), calls)
    return lines + ([registration, ""] if registration else [])


def _runs_sentence(spec: dict, exp_dir: Path, calls: list[dict], arms: dict, tuning: dict) -> str:
    """'Seeds [...] (...); N runs of R rounds × P prompts; one run took …' with the experiment's time."""
    tune = spec.get("tune") or {}
    tune_seeds = [int(x) for x in tune.get("seeds") or []]
    wall = [run["summary"]["wall_s"] for runs in arms.values() for run in runs]
    seeds = sorted({run["seed"] for runs in arms.values() for run in runs})
    n_tuning = sum(len(r) for a, r in tuning.items() if a in (tune.get("arms") or []))
    return (f"Seeds {seeds} ({'each with its own SFT base' if spec.get('per_seed_base', True) else 'one shared base'}); "
            f"{len(wall)} runs{f' (and {n_tuning} tuning runs on seeds {tune_seeds})' if n_tuning else ''} of {max(len(r['metrics']) - 1 for runs in arms.values() for r in runs)} rounds"
            f"{prompts_per_round(exp_dir, arms)}; "
            f"one run took {min(wall) / 60:.1f}–{max(wall) / 60:.1f} min on one CPU thread"
            + experiment_time(exp_dir, calls))


def _compared_bases(scored: dict[str, tuple[dict, dict, dict]]) -> dict[int, dict[str, float]]:
    """{seed: {arm: base pass@1}} of the compared runs, as ``arm_scores`` took them (tuning seeds are never paired)."""
    base_by_seed: dict[int, dict[str, float]] = {}
    for arm, (_, _, bases) in scored.items():
        for seed, v in bases.items():
            if math.isfinite(v):
                base_by_seed.setdefault(seed, {})[arm] = v
    return base_by_seed


def _comparisons(pairs: list[tuple[str, str]], scored: dict[str, tuple[dict, dict, dict]],
                 mixed: dict[int, dict[str, float]], tuned: str | None, both_collapse: bool | None,
                 margin: float = MARGIN) -> tuple[list[str], list]:
    """(one finding per pair: ``stats.paired_interval``'s sentence with its marks and, where "both collapse"
    decided, what the earlier rules read, labelled by ``both_collapse`` (``provenance.rule_standing``);
    [(``stats.tost`` result, whether the interval rule read 'match')] for the pairs not both collapsed)."""
    findings, equivalence = [], []
    for a, b in pairs:
        if missing := [x for x in (a, b) if x not in scored]:
            findings.append(f"{a} vs {b}: not compared (arm {missing[0]} has no finished runs).")
            continue
        mark = f" ({tuned} is the tuned baseline)" if tuned in (a, b) else ""
        if broken := sorted(s for s, arms in mixed.items() if a in arms and b in arms and arms[a] != arms[b]):
            mark += f" (bases differ at seeds {broken}: not a clean pairing)"
        try:
            both = {s for s, why in scored[a][1].items() if why} & {s for s, why in scored[b][1].items() if why}
            result = paired_interval(a, b, scored[a][0], scored[b][0], comparisons=len(pairs), collapsed_both=both)
            note = result.earlier_rules_note()
            label = f"'both collapse' (`{BOTH_COLLAPSE_RULE}`, {standing_label(both_collapse)}) decided this"
            findings.append(result.sentence() + mark + (f"\n  - {label}; {note}." if note else ""))
            if not result.both_collapsed:  # scores at the floor: not a question of equivalence
                equivalence.append((tost(a, b, scored[a][0], scored[b][0], comparisons=len(pairs), margin=margin),
                                    result.verdict() == "match"))
        except ValueError as e:
            findings.append(f"{a} vs {b}: not compared ({e}).{mark}")
    return findings, equivalence


def _secondary_lines(spec: dict, pairs: list[tuple[str, str]], scored: dict[str, tuple[dict, dict, dict]],
                     label: str) -> list[str]:
    """The Wilcoxon sensitivity lines (``wilcoxon: true``) and the interaction (``interaction:``) of an experiment
    that asks for them, under the rule of ``stats.SENSITIVITY_RULE`` labelled ``label``; [] otherwise."""
    lines = []
    if spec.get("wilcoxon"):
        lines += [f"**Sensitivity: Wilcoxon signed-rank** (rule of `{SENSITIVITY_RULE}`, {label}; beside the interval, "
                  "it decides no verdict):", ""]
        for a, b in pairs:
            if a not in scored or b not in scored:
                lines.append(f"- {a} vs {b}: no signed-rank test (an arm without finished runs).")
                continue
            try:
                test = signed_rank(a, b, scored[a][0], scored[b][0])
                result = paired_interval(a, b, scored[a][0], scored[b][0], comparisons=len(pairs))
            except ValueError as e:
                lines.append(f"- {a} vs {b}: no signed-rank test ({e}).")
                continue
            # each at the family's level: the interval excludes 0 exactly when its t-test rejects
            level = 1 - result.level
            disagree = (test.p < level) != (result.lo > 0 or result.hi < 0)
            lines.append(f"- {test.sentence()}" + (
                f" It and the interval disagree at α = {level:.4g}; the registered verdict is the interval's."
                if disagree else ""))
        lines.append("")
    if spec.get("interaction"):
        (a1, b1), (a2, b2) = [tuple(p) for p in spec["interaction"]]
        try:
            text = interaction(((a1, b1), (a2, b2)), {arm: s[0] for arm, s in scored.items()}).sentence()
        except ValueError as e:
            text = f"not computed ({e})."
        lines += [f"**Interaction** (secondary, outside the primary family; rule of `{SENSITIVITY_RULE}`, {label}):", "",
                  f"- {text}", ""]
    return lines


def write_report(runs: Path, out: Path, experiments: list[str] | None = None, *, figures: str = "draw") -> Path:
    """Write ``out/README.md`` and the figures for ``experiments`` (default: every experiment under ``runs``).

    ``figures``: "draw" (write the figures and link them), "none" (the text alone: no figure file and no link, the
    committed form of a text-only report, ``lab report --text-only``), or "link" (the links without drawing: what
    a check of a report whose figures are committed needs, at a fraction of the time).

    Raises:
        UserError: ``runs`` holds no experiment, or ``figures`` is none of those.
    """
    if figures not in FIGURES:
        raise UserError(f"figures must be one of {', '.join(FIGURES)}, got {figures!r}")
    if not runs.is_dir():
        raise UserError(f"no lab runs in {str(runs)!r}; run `trustbatch lab run EXPERIMENT --out {runs}` first")
    names = experiments or sorted(p.name for p in runs.iterdir() if (p / "experiment.yaml").exists())
    if not names:
        raise UserError(f"no experiments under {str(runs)!r}")
    out.mkdir(parents=True, exist_ok=True)
    sections, findings, commits, opted_in = [], [], {}, set()
    for n in names:
        if not (runs / n).is_dir():
            raise UserError(f"experiment {n!r} has no runs in {str(runs)!r}")
        text, f = experiment_section(n, runs / n, out, figures=figures)
        sections.append(text)
        findings += f
        spec, _ = experiment_spec(n, runs / n)
        commits[n] = run_commits(spec, load_calls(runs / n))
        if spec.get("wilcoxon") or spec.get("interaction"):
            opted_in.add(n)
    command = (f"trustbatch lab report {' '.join(experiments or [])}{' ' if experiments else ''}--runs {runs} --out {out}"
               + (" --text-only" if figures == "none" else ""))
    head = [
        "# Off-policy lab report", "",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} from `{runs}` at commit `{git_commit()}` by `{command}`.", "",
        *header_lines(runs, names, commits, figures=figures != "none", opted_in=opted_in),
        *preflight_summary(runs),
        *base_table({n: base_fingerprints(runs / n) for n in names}),
        "## All findings", "",
        *[f"- {f}" for f in findings], "",
        *cost_table({n: experiment_cost(runs / n) for n in names}),
    ]
    path = out / "README.md"
    atomic_write(path, "\n".join(head + sections) + "\n")
    return path
