"""The record of every ``trustbatch lab run`` call on one experiment folder: ``OUT/EXPERIMENT/calls.jsonl``.

An experiment is often run in several calls: seeds added later, a follow-up arm, a resume after an
interruption, sometimes two calls at once on different seeds. One line per call keeps what each did
(its seeds, arms, commit, command, start and end) so the folder's provenance is not overwritten by
the last call, and the experiment's cost is the wall-clock time covered by the calls (the union of
their intervals), which a sum of their durations overstates when calls overlap.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..records import atomic_write

CALLS = "calls.jsonl"
WALL = "wall_s.txt"


def load_calls(exp_dir: Path) -> list[dict]:
    """The call records of ``exp_dir`` in the order written ([] when there is no ``calls.jsonl``).

    Raises:
        ValueError: a line is not JSON (names the file and line).
    """
    path = Path(exp_dir) / CALLS
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i} is not JSON ({e.msg}); remove or repair that line") from None
    return out


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals (seconds): overlapping calls count once.

    Intervals with end < start are ignored.
    """
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e >= s):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def elapsed_seconds(calls: list[dict]) -> float:
    """The experiment's wall-clock cost: the union of the calls' intervals, plus any ``legacy_wall_s``
    (the summed ``wall_s.txt`` of calls made before ``calls.jsonl`` existed, kept as a first record)."""
    legacy = sum(float(c.get("legacy_wall_s", 0.0)) for c in calls)
    return legacy + covered_seconds([(c["start"], c["end"]) for c in calls if "start" in c and "end" in c])


def record_call(exp_dir: Path, call: dict) -> float:
    """Append ``call`` to ``calls.jsonl`` and rewrite ``wall_s.txt`` as ``elapsed_seconds``; returns that.

    A folder whose ``wall_s.txt`` predates ``calls.jsonl`` keeps its seconds as a ``legacy_wall_s``
    record first. Both files are rewritten whole through a temporary file (never half-written).
    """
    exp_dir = Path(exp_dir)
    calls = load_calls(exp_dir)
    wall = exp_dir / WALL
    if not calls and wall.exists():
        try:
            calls.append({"legacy_wall_s": float(wall.read_text())})
        except ValueError:
            pass
    calls.append(call)
    atomic_write(exp_dir / CALLS, "".join(json.dumps(c) + "\n" for c in calls))
    elapsed = elapsed_seconds(calls)
    atomic_write(wall, f"{elapsed:.0f}\n")
    return elapsed
