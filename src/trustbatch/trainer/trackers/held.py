"""What each tracker's run holds of ``metrics.jsonl``, kept in ``RUN_DIR/tracked.json`` so that a resume can make
every tracker agree with the record: the rounds it lacks are sent again, the rounds it holds twice are dropped.

A tracker's entry: ``through``, the last round up to which its run holds every round of ``metrics.jsonl`` exactly
once (-1: none); ``stale``, whether its run may also hold rounds after ``through`` that a resume redid (their values
are not the record's); and the tracker's own keys (W&B's finished run folders). ``open`` names the trackers of the
latest start: they may have been sent rounds past their ``through`` before it ended.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...records import atomic_write

HELD_FILE = "tracked.json"


class Held:
    """``RUN_DIR/tracked.json``, read once and written whole (``atomic_write``) at each change."""

    def __init__(self, run_dir: Path, fresh: bool = False):
        self.path = Path(run_dir) / HELD_FILE
        self.data: dict = {} if fresh or not self.path.exists() else json.loads(self.path.read_text())

    def entry(self, name: str) -> dict:
        """The tracker's entry (mutable; ``save`` writes it), created holding nothing."""
        return self.data.setdefault(name, {"through": -1})

    def redo_after(self, start: int, last_logged: int, stored_ids: dict) -> None:
        """A resume from the checkpoint of round ``start`` (-1: none) redoes the rounds after it.

        ``last_logged``: the last round ``metrics.jsonl`` held before the resume cut it back to ``start`` (-1: none);
        a tracker is sent a round only once ``metrics.jsonl`` holds it, so no tracker holds a later one.
        ``stored_ids``: ``trackers.json``'s run ids: a run that has an id but no entry (a run directory from before
        this file) may hold anything. Every tracker then holds at most the rounds up to ``start`` as the record has
        them; the ones it may hold after (sent before the resume, or possibly so) mark it ``stale``.
        """
        was_open = set(self.data.get("open", []))
        for name in set(stored_ids) - set(self.data):
            self.data[name] = {"through": -1, "stale": True}
        for name, e in self.data.items():
            if name == "open":
                continue
            if e["through"] > start or (name in was_open and last_logged > e["through"]):
                e["stale"] = True
            e["through"] = min(e["through"], start)

    def opened(self, names: list[str]) -> None:
        """The trackers of this start, from which on they may be sent rounds; written before the first is sent (not
        at all for a run that never had a tracker)."""
        self.data["open"] = list(names)
        if names or self.path.exists():
            self.save()

    def advance(self, round_: int, names: list[str]) -> None:
        """The named trackers hold every round up to ``round_`` (each stored its rounds before returning).

        Written at a start's end of sending the rounds a tracker lacks, at each checkpoint and at the end, not every
        round: a resume from a checkpoint finds each tracker holding every round up to it (the round's checkpoint is
        written after the round was sent), and one that was open may hold rounds after ``through`` (``redo_after``).
        """
        if names:
            for name in names:
                self.entry(name)["through"] = round_
            self.save()

    def save(self) -> None:
        atomic_write(self.path, json.dumps(self.data, indent=1))
