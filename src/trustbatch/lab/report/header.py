"""The report's opening: what ran (each experiment's settings as its runs' own configs record them) and how each
rule of ``lab.stats`` stands against the runs (fixed before them or post hoc, by git ancestry)."""

from __future__ import annotations

from pathlib import Path

from .. import records
from ..stats import BOTH_COLLAPSE_RULE, MARGIN, OPT_IN_RULES, RULES, SCORE_RULES
from .provenance import rule_standing
from .runs import run_config


def run_settings(exp_dir: Path) -> tuple[list[int], int, list[str]]:
    """(seeds, finished runs, the distinct settings of those runs) of one experiment, each setting read from a
    run's resolved config (``ARM/seedK.yaml``) as "R rounds × P prompts × G samples, held-out H × S every E
    rounds"; a run without its config counts as "config not archived"."""
    seeds, settings, n = set(), set(), 0
    for run in records.finished_runs(exp_dir):
        n += 1
        seeds.add(int(run.name.removeprefix("seed")))
        cfg_file = run.parent / f"{run.name}.yaml"
        if not records.exists(cfg_file):
            settings.add("config not archived")
            continue
        c = run_config(cfg_file)
        tr, ro, ev = c.get("train", {}), c.get("rollout", {}), c.get("eval", {})
        steps = f", {tr['epochs'] * tr['minibatches']} optimizer steps per round" if tr.get("epochs", 1) * tr.get("minibatches", 1) > 1 else ""
        settings.add(f"{tr.get('steps')} rounds × {ro.get('prompts_per_step')} prompts × {ro.get('group_size')} samples{steps}, "
                     f"held-out {c.get('task', {}).get('heldout_size')} × {ev.get('samples_per_prompt')} every {ev.get('every')} rounds")
    return sorted(seeds), n, sorted(settings)


def settings_table(runs: Path, names: list[str]) -> list[str]:
    """Markdown lines: per experiment its seeds, finished runs and settings (``run_settings``)."""
    lines = ["| experiment | seeds | runs | settings (from the runs' own configs) |", "|---|---|---|---|"]
    for name in names:
        seeds, n, settings = run_settings(runs / name)
        if n:
            lines.append(f"| {name} | {_span(seeds)} | {n} | {'; '.join(settings)} |")
    return lines + [""]


def _span(seeds: list[int]) -> str:
    """"10–17" for a run of consecutive seeds, else the list."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def rules_table(commits: dict[str, list[str | None]], opted_in: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Markdown lines: each rule of ``stats.RULES`` with the experiments whose runs it was fixed before, those for
    which it is post hoc, and those where that is not known (``provenance.rule_standing`` on each experiment's
    recorded commits, ``commits``: {experiment: commits}). A rule of ``stats.OPT_IN_RULES`` judges only the
    experiments in ``opted_in`` (those whose YAML asks for it), and has no row when none does."""
    lines = ["| rule | commit | fixed before the runs of | post hoc for | not known for |", "|---|---|---|---|---|"]
    for rule, commit in RULES.items():
        judged = {n: cs for n, cs in commits.items() if rule not in OPT_IN_RULES or n in opted_in}
        if not judged:
            continue
        by: dict[bool | None, list[str]] = {True: [], False: [], None: []}
        for name, cs in judged.items():
            by[rule_standing(commit, cs)].append(name)
        lines.append(f"| {rule} | `{commit}` | " + " | ".join(", ".join(by[k]) or "–" for k in (True, False, None)) + " |")
    return lines + [""]


def header_lines(runs: Path, names: list[str], commits: dict[str, list[str | None]], *, figures: bool,
                 opted_in: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The report's opening paragraphs after its title and "Generated" line (``figures``: the report links figures;
    ``opted_in``: the experiments that ask for ``stats.OPT_IN_RULES``, ``rules_table``)."""
    trace = (["The trace figures (`*_traces.png`) are drawn against the optimizer step. A run with several optimizer steps "
              "per round that has `steps.jsonl` shows every step; one from before that file existed shows its round "
              "means, each at the round's last step.", ""] if figures else
             ["Text only (`--text-only`): `trustbatch lab report` without that option draws the figures from the same runs.", ""])
    return [
        "Every run is `trustbatch train`; between the arms of an experiment only the behaviour shift and the objective "
        "change, and nothing was tuned for any arm (a tuned baseline says so in its section). What ran, from the "
        "archived runs themselves:", "",
        *settings_table(runs, names),
        *trace,
        "The rules (`src/trustbatch/lab/stats.py`): the primary score is the mean of the last two held-out "
        "evaluations; a run collapses when its primary score is below half of its base or its training reward "
        "(10-round mean) ends below half of its peak; arms are compared by paired t-intervals over seeds with a "
        f"Bonferroni correction per experiment, and 'match' is claimed only inside ±{MARGIN}; two arms that collapse "
        "in every common seed read 'both collapse'. A rule is fixed before an experiment's runs exactly when its "
        "commit is an ancestor of every commit the experiment's `lab run` calls recorded, post hoc when it is not an "
        "ancestor of one of them, and not known when a call recorded no commit; this table is computed from git "
        "history, not written by hand:", "",
        *rules_table(commits, opted_in),
        f"Beside each verdict that 'both collapse' (`{BOTH_COLLAPSE_RULE}`) decided, the report prints what the rules "
        f"of `{SCORE_RULES}` alone read: 'both collapse' was written after the first runs in which every arm "
        "collapsed had been seen (runs no archive holds).", "",
    ]
