"""``trustbatch lab compare``: does a re-run reproduce the archived run, value for value?

The archive was built over several sessions, at several commits. Re-running a sample of its runs at one
commit and finding every logged value equal shows that the archive is what that commit produces (on this
machine and package set: a base build, and so every run on it, is deterministic on one machine, not across
machines). A difference names the first round and metric where the two runs part.

Compared: the resolved config (``ARM/seedK.yaml``, less ``run_dir``), then every record of
``metrics.jsonl`` in file order, key by key, with exact float equality. Wall-clock measurements (keys
ending in ``_s``, such as ``rollout_s``, ``step_s`` and ``tokens_per_s``) are left out: they are the one
thing a re-run is not expected to repeat. So are keys the archived run never logged in any record (a metric
added to the logs after the archive was made, e.g. ``heldout_accuracy_se``): there is nothing to compare them
with, and every value the archive holds is still compared. And so are the keys whose definition changed after
archives were made (``REDEFINED``): a re-run computes another quantity under the same name, so equality says nothing.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import _flatten  # the dotted keys overrides use
from ..errors import UserError
from ..records import atomic_write
from . import records
from .calls import load_calls

SCORE_KEY = "heldout_accuracy"  # held-out pass@1, the lab's score
# Written into ARCHIVE/EXPERIMENT by ``lab compare --record`` and read by the report. ``lab archive`` replaces an
# experiment's folder whole and does not carry this file over, so a record never outlives the runs it checked.
RECORD = "reproduced.json"


# Keys redefined on 2026-11-29, after every archive in docs/lab*/archive was made: a round's maxima over its optimizer
# steps (they were means of the steps' maxima), pass@k at the full reward (at reward >= 0.5 before, which counted the
# default task's partial credit), dynamic sampling's length and truncation over every sampled completion (over the
# kept groups before). Every other key is still compared, and the rollouts and updates behind these with it.
REDEFINED = ("ratio_max", "abs_log_ratio_max", "heldout_pass@", "response_length", "truncated_fraction")


def is_redefined(key: str) -> bool:
    """True for a key ``REDEFINED`` names; a name ending in ``@`` names every k (``heldout_pass@8``)."""
    return any(key == r or (r.endswith("@") and key.startswith(r)) for r in REDEFINED)


def is_timing(key: str) -> bool:
    """True for a wall-clock measurement (``rollout_s``, ``step_s``, ``tokens_per_s``), which no re-run repeats."""
    return key.endswith("_s")


@dataclass
class RunComparison:
    """One re-run against its archived counterpart.

    ``values``: logged values compared, each record's ``step`` included and timing keys excluded;
    ``differing``: how many were unequal (a value one side lacks counts, as ``ABSENT`` in ``first``);
    ``first``: the first difference as (step, key, archived value, re-run value), or ``None``;
    ``score_max_abs_diff``: the largest |Δ| of held-out pass@1 over the records where both runs logged a
    finite one (NaN on both sides counts as 0), ``None`` when no record has it on both sides;
    ``config_diff``: the resolved-config keys whose values differ (dotted), or ``"FILE missing"`` entries,
    empty when the configs are equal.
    """

    experiment: str
    arm: str
    seed: str
    records: tuple[int, int]  # (archived, re-run)
    values: int
    differing: int
    first: tuple | None
    score_max_abs_diff: float | None
    config_diff: list[str]

    @property
    def identical(self) -> bool:
        return not self.config_diff and self.differing == 0 and self.records[0] == self.records[1]


ABSENT = "<absent>"  # a key one side did not log (not the same as a logged null)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def config_diff(archived: Path, rerun: Path) -> list[str]:
    """Dotted keys whose values differ between two resolved run configs (``run_dir`` ignored; a missing file
    on either side is reported as ``"FILE missing"``, naming it)."""
    gone = [f"{p} missing" for p in (archived, rerun) if not records.exists(p)]
    if gone:
        return gone
    a, b = _flatten(records.read_yaml(archived) or {}), _flatten(records.read_yaml(rerun) or {})
    return sorted(k for k in a.keys() | b.keys() if k != "run_dir" and not (k in a and k in b and _same(a[k], b[k])))


def compare_run(archived: Path, rerun: Path, experiment: str = "", arm: str = "", seed: str = "") -> RunComparison:
    """Compare the run folder ``rerun`` with ``archived`` (each holding ``metrics.jsonl``; their configs sit
    beside them as ``../seedK.yaml``; either side's files may be packed, ``lab.records``).

    Records are paired in file order; a run that logged more records than the other counts each extra
    record's values as differing. Exact equality: a re-run on the same machine at a commit whose training
    path is unchanged repeats every float bit for bit, so any tolerance would hide a real change.

    Raises:
        UserError: either folder has no ``metrics.jsonl``.
    """
    for p in (archived, rerun):
        if not records.exists(p / "metrics.jsonl"):
            raise UserError(f"{p} has no metrics.jsonl; pass run folders of `trustbatch lab run` (OUT/EXPERIMENT/ARM/seedK)")
    old, new = records.read_jsonl(archived / "metrics.jsonl"), records.read_jsonl(rerun / "metrics.jsonl")
    logged = {key for rec in old for key in rec}
    values = differing = 0
    first = None
    score_diffs = []
    for i in range(max(len(old), len(new))):
        a = old[i] if i < len(old) else {}
        b = new[i] if i < len(new) else {}
        step = a.get("step", b.get("step"))
        for key in ["step"] + sorted((a.keys() | b.keys()) - {"step"}):
            if is_timing(key) or key not in logged or is_redefined(key):
                continue
            values += 1
            va, vb = a.get(key, ABSENT), b.get(key, ABSENT)
            if key == SCORE_KEY and isinstance(va, (int, float)) and isinstance(vb, (int, float)):
                gap = abs(va - vb)
                score_diffs.append(0.0 if math.isnan(va) and math.isnan(vb) else gap)
            if not _same(va, vb):
                differing += 1
                if first is None:
                    first = (step, key, va, vb)
    cfg = config_diff(archived.parent / f"{archived.name}.yaml", rerun.parent / f"{rerun.name}.yaml")
    finite = [d for d in score_diffs if math.isfinite(d)]  # NaN against a number: a difference, not a gap size
    return RunComparison(experiment, arm, seed, (len(old), len(new)), values, differing, first,
                         max(finite) if finite else None, cfg)


def compare_runs(runs: Path, archive: Path, experiments: list[str] | None = None) -> list[RunComparison]:
    """Every finished run under ``runs`` (``EXPERIMENT/ARM/seedK`` with a ``summary.json``) that the archive also
    holds, compared with it. Experiments and runs the archive lacks are skipped (a re-run of a sample is the
    point); a run folder reached twice (an arm linked into several experiments) is compared once.

    Raises:
        UserError: ``runs`` or ``archive`` is not a folder, a named experiment is missing from either (says
            which), or no run under ``runs`` has an archived counterpart.
    """
    runs, archive = Path(runs), Path(archive)
    for p, opt in ((runs, "--runs"), (archive, "--archive")):
        if not p.is_dir():
            raise UserError(f"{opt} {p} is not a folder; pass the --out of `trustbatch lab run` and of `trustbatch lab archive`")
    if experiments:
        for opt, root in (("--runs", runs), ("--archive", archive)):
            missing = [n for n in experiments if not (root / n).is_dir()]
            if missing:
                raise UserError(f"experiment {', '.join(missing)} is not under {opt} {root}; fix the name")
        names = list(experiments)
    else:
        names = sorted(p.name for p in runs.iterdir() if p.is_dir() and (archive / p.name).is_dir())
    out, seen = [], set()
    for name in names:
        for run in records.finished_runs(runs / name):
            arm = run.parent.name
            old = archive / name / arm / run.name
            if records.exists(old / "metrics.jsonl") and run.resolve() not in seen:
                seen.add(run.resolve())
                out.append(compare_run(old, run, name, arm, run.name))
    if not out:
        raise UserError(f"no finished run under {runs} has a counterpart in {archive}; re-run some with `trustbatch lab run EXP --seeds S --arms A --out {runs}`")
    return out


def comparison_line(c: RunComparison) -> str:
    """One line per run: ``identical`` or where the re-run parts from the archive."""
    head = f"{c.experiment} {c.arm} {c.seed}:"
    gone = [k for k in c.config_diff if k.endswith(" missing")]
    if gone:
        return f"{head} no resolved config to check ({'; '.join(gone)}); copy the run's seedK.yaml beside it"
    if c.config_diff:
        more = f" and {len(c.config_diff) - 4} more" if len(c.config_diff) > 4 else ""
        return f"{head} config differs ({', '.join(c.config_diff[:4])}{more}); not a re-run of the same run"
    if c.identical:
        return f"{head} identical ({c.records[0]} records, {c.values} values)"
    step, key, va, vb = c.first
    score = "" if c.score_max_abs_diff is None else f"; held-out pass@1 max |Δ| {c.score_max_abs_diff:.4f}"
    return (f"{head} differs: {c.differing} of {c.values} values, first at step {step} {key} ({va!r} archived, {vb!r} re-run); "
            f"records {c.records[0]} archived, {c.records[1]} re-run{score}")


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def record_comparisons(results: list[RunComparison], runs: Path, archive: Path) -> list[Path]:
    """Write ``ARCHIVE/EXPERIMENT/reproduced.json`` for each experiment in ``results`` (replacing an older one):
    the commits of the ``lab run`` calls that made the re-runs (``RUNS/EXPERIMENT/calls.jsonl``; ``["unknown"]``
    without one), when it was written, and one entry per re-run (the ``RunComparison`` fields, non-finite
    floats as null). The report reads it. Returns the paths written.
    """
    paths = []
    for name in sorted({c.experiment for c in results}):
        commits = sorted({str(c.get("commit", "unknown")) for c in load_calls(Path(runs) / name) if "start" in c}) or ["unknown"]
        entries = [{k: _json_safe(v) for k, v in asdict(c).items() if k != "experiment"} | {"identical": c.identical}
                   for c in results if c.experiment == name]
        path = Path(archive) / name / RECORD
        atomic_write(path, json.dumps({"commits": commits, "written": time.strftime("%Y-%m-%d %H:%M"), "runs": entries}, indent=1) + "\n")
        paths.append(path)
    return paths


def reproduced_line(exp_dir: Path) -> str | None:
    """The report's one line on an experiment's re-run check (``RECORD`` in ``exp_dir``), or None without one."""
    path = Path(exp_dir) / RECORD
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
        runs = rec["runs"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"**Re-run check:** `{path.name}` is unreadable; run `trustbatch lab compare --record` again."
    same = [r for r in runs if r.get("identical")]
    named = ", ".join(f"{r['arm']} {r['seed']}" for r in same)
    text = (f"**Re-run check** (`trustbatch lab compare --record`, {rec.get('written', '?')}): {len(same)} of {len(runs)} "
            f"runs re-run at commit {', '.join(f'`{c}`' for c in rec.get('commits', ['unknown']))} are identical to these, "
            f"value for value, wall-clock keys aside" + (f" ({named})" if named else ""))
    for r in runs:
        if r.get("identical"):
            continue
        if r.get("config_diff"):
            text += f"; {r['arm']} {r['seed']}: config differs ({', '.join(r['config_diff'][:4])})"
        else:
            step, key = (r.get("first") or [None, None])[:2]
            gap = r.get("score_max_abs_diff")
            text += (f"; {r['arm']} {r['seed']} differs from step {step} ({key})"
                     + (f", held-out pass@1 by up to {gap:.3f}" if isinstance(gap, (int, float)) else ""))
    return text + "."
