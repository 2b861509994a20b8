"""Where the numbers come from: git commits (the runs' and this checkout's), a registered design checked
against its calls, each call's record and the experiment's time and cost, the prompts per round from the runs'
own configs, and each run's base fingerprint (round-0 held-out score) to tell which runs share a base."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import time
from pathlib import Path

import yaml

from .. import records
from ...records import git_commit
from ..calls import WALL, covered_seconds, elapsed_seconds, load_calls
from ..experiment import ANALYSIS_KEYS, LAB_SEEDS, default_comparisons
from .runs import run_config


def descends(commit: str, ancestor: str) -> bool | None:
    """Whether ``commit`` is ``ancestor`` or descends from it in this checkout's git history; None when git cannot
    say (no git, no history, an unknown commit)."""
    try:
        r = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], capture_output=True,
                           cwd=Path(__file__).parent)
    except OSError:
        return None
    return {0: True, 1: False}.get(r.returncode)


EXPERIMENTS_DIR = "src/trustbatch/lab/experiments"  # a bundled experiment's YAML, in the repository


# what a registration fixes and ``lab run`` copies into the folder's experiment.yaml: a later edit must not change it
DESIGN_KEYS = ("seeds", "compare") + ANALYSIS_KEYS


def registered_design(name: str, registered: str | None) -> dict:
    """The design keys (``DESIGN_KEYS``) of experiment ``name``'s YAML as the registration commit ``registered``
    holds it (``git show``); {} without a registration, or when git or the file cannot say."""
    return dict(_registered_design(name, registered)) if registered else {}


@functools.lru_cache(maxsize=None)  # a commit's files never change: one `git show` per experiment and report
def _registered_design(name: str, registered: str) -> tuple:
    try:
        r = subprocess.run(["git", "show", f"{registered}:{EXPERIMENTS_DIR}/{name}.yaml"], capture_output=True,
                           text=True, cwd=Path(__file__).parent)
        spec = yaml.safe_load(r.stdout) if r.returncode == 0 else None
    except (OSError, yaml.YAMLError):
        return ()
    if not isinstance(spec, dict):
        return ()
    # a key the registration left out holds its default there, so a later edit that sets it is a change too
    defaults = {"seeds": list(LAB_SEEDS), "compare": [], "wilcoxon": False, "equivalence_margin": None,
                "interaction": None}
    return tuple((k, spec.get(k, defaults[k])) for k in DESIGN_KEYS)


def _same(key: str, folder, registered, arms: list[str]) -> bool:
    if key == "seeds":  # fewer seeds is a design not yet run to the end, not a change
        return {int(x) for x in folder or []} <= {int(x) for x in registered or []}
    if key == "compare":  # no compare list means the default pairs of the arms it runs: the same design
        def pairs(c):
            return [list(p) for p in (c or default_comparisons(arms))]
        return pairs(folder) == pairs(registered)
    return (folder or None) == (registered or None)


def experiment_spec(name: str, exp_dir: Path) -> tuple[dict, str | None]:
    """The folder's ``experiment.yaml`` ({} without one) with, for a registered experiment, its design as the
    registration commit's YAML gives it, and a line that says what the folder's copy left out or changed (else
    None).

    The registered design (seeds, comparisons, analysis keys) is read from where it was registered, never from a
    later edit: ``lab run`` copies the YAML it runs into the folder, so an edit after the results (another primary
    pair, a wider margin, more seeds) would otherwise be analysed as if registered. The report names such a
    change as post hoc and analyses the registration's design (runs of seeds it does not hold are left out,
    ``registered_seeds``). ``lab run`` before the fix of issue 47's Lab IV wrote the design without the analysis
    keys: those are completed from the registration, as a runner bug, not a change."""
    path = exp_dir / "experiment.yaml"
    spec = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
    reg = registered_design(name, spec.get("registered"))
    if not reg:
        return spec, None
    missing = [k for k in ANALYSIS_KEYS if k not in spec and reg[k] not in (None, False)]
    planned = [a for a in spec.get("arms") or {} if a not in (spec.get("preflight_only") or [])]
    changed = [k for k in DESIGN_KEYS if k in spec and not _same(k, spec[k], reg[k], planned)]
    lines = []
    if missing:
        keys = ", ".join(f"`{k}`" for k in missing)
        lines.append(f"The analysis keys {keys} are read from `{EXPERIMENTS_DIR}/{name}.yaml` at the registration "
                     f"commit `{spec['registered']}`: the folder's `experiment.yaml`, written by `lab run`, left them "
                     "out (a runner bug, fixed after these runs).")
    if changed:
        said = "; ".join(f"`{k}` {json.dumps(spec[k])} where the registration has {json.dumps(reg[k])}" for k in changed)
        lines.append(f"**Post hoc, not analysed:** the folder's `experiment.yaml` differs from the design registered "
                     f"at `{spec['registered']}` ({said}). This report analyses the registered design"
                     + (", and only the registered seeds' runs" if "seeds" in changed else "") + ".")
    return {**spec, **reg}, (" ".join(lines) or None)


def registered_seeds(spec: dict) -> set[int] | None:
    """The seeds a registered experiment's analysis may use (``experiment_spec``'s ``seeds``), None when it is
    not registered or lists no seeds (every finished run counts)."""
    return {int(x) for x in spec["seeds"]} if spec.get("registered") and spec.get("seeds") else None


def run_commits(spec: dict, calls: list[dict]) -> list[str | None]:
    """The recorded commit of every ``lab run`` call that trained runs of an experiment: each call's ``commit`` in
    ``calls.jsonl`` (None for a call without one, such as a ``legacy_wall_s`` record of calls made before the file
    existed), or ``experiment.yaml``'s ``commit`` (``spec``) for an experiment without ``calls.jsonl``; [] when
    neither is recorded."""
    if calls:
        return [str(c["commit"]) if c.get("commit") else None for c in calls]
    return [str(spec["commit"])] if spec.get("commit") else []


def rule_standing(rule: str, commits: list[str | None]) -> bool | None:
    """Whether the rule introduced at commit ``rule`` was fixed before the runs made at ``commits``
    (``stats`` module docstring): True when ``rule`` is an ancestor of (or is) every one of them, False when it is
    not an ancestor of one of them (post hoc), None when a commit is unrecorded, there is none, or git cannot say."""
    standing = [None if c is None else descends(c, rule) for c in commits]
    if any(s is False for s in standing):
        return False
    return True if standing and all(standing) else None


def standing_label(standing: bool | None) -> str:
    """The words the report uses for ``rule_standing``'s answer."""
    return {True: "fixed before these runs", False: "post hoc"}.get(standing, "not known to precede these runs")


def registration_line(registered: str | None, calls: list[dict]) -> str | None:
    """The report's line on a registered design: whether every ``lab run`` call's commit descends from the
    registration commit; None for an experiment without ``registered``."""
    if not registered:
        return None
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
    return f"**Registered** at `{registered}` before any run: {check}."


def calls_line(calls: list[dict]) -> str:
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


def experiment_time(exp_dir: Path, calls: list[dict]) -> str:
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


def prompts_per_round(exp_dir: Path, arms: dict[str, list[dict]]) -> str:
    """' × N prompts' from the runs' own configs (an experiment run before LAB_COMMON changed keeps its own)."""
    sizes = set()
    for arm, runs in arms.items():
        for run in runs:
            f = exp_dir / arm / f"seed{run['seed']}.yaml"
            if records.exists(f):
                sizes.add(run_config(f).get("rollout", {}).get("prompts_per_step"))
    sizes.discard(None)
    return f" × {'/'.join(str(x) for x in sorted(sizes))} prompts" if sizes else ""


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


def mixed_line(mixed: dict[int, dict[str, float]]) -> str:
    """A report line naming the arms whose bases differ at each mixed seed."""
    parts = [f"seed {s}: " + ", ".join(f"{a} {v:.4f}" for a, v in sorted(arms.items()))
             for s, arms in sorted(mixed.items())]
    return ("**Mixed bases:** arms of this experiment started from bases that score differently at round 0, so "
            "their pairing at these seeds compares different bases (" + "; ".join(parts) + ").")


def _reused(exp_dir: Path, arm_dir: Path, run_name: str) -> bool | None:
    """Whether a run was trained in another experiment's folder and copied or linked here (an ``onpolicy``
    reference): its resolved config's ``run_dir`` names another experiment (``.../EXPERIMENT/ARM/seedK``).
    None when the run has no config beside it (``ARM/seedK.yaml``), so its origin is unknown."""
    cfg = arm_dir / f"{run_name}.yaml"
    if not records.exists(cfg):
        return None
    run_dir = run_config(cfg).get("run_dir")
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
        preflight_s: the pre-flight's seconds from ``preflight.json``'s ``start`` and ``end``; None when it has
            none (a pre-flight from before they were recorded), False when the experiment has no pre-flight.
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
    pre = json.loads((exp_dir / "preflight.json").read_text()) if (exp_dir / "preflight.json").exists() else False
    pre_s = pre if pre is False else (pre["end"] - pre["start"] if isinstance(pre, dict) and "end" in pre else None)
    return {"own": len(own), "reused": reused, "reused_s": reused_s, "unknown": unknown, "wall_s": wall_s, "preflight_s": pre_s,
            "build_s": build_s, "builds_partial": build_s is not None and any("legacy_wall_s" in c for c in calls),
            "run_s": (min(own), max(own)) if own else None}
