"""Experiment trackers: where each round's metrics go besides ``metrics.jsonl`` (TensorBoard, W&B, MLflow).

One module per backend, each a class with ``Tracker``'s methods; its package is imported only when the tracker is
opened, so an extra that is not installed costs nothing until ``log.trackers`` names it. The id of every tracker's
run is kept in ``RUN_DIR/trackers.json``: a resumed run continues the same W&B and MLflow runs. What each run holds
of ``metrics.jsonl`` is kept in ``RUN_DIR/tracked.json`` (``held``): a resume sends each tracker the rounds it lacks
and drops those it holds from before the resume redid them (``Tracker.start``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import random
from pathlib import Path
from typing import Protocol

from ...errors import UserError
from ...records import atomic_write
from .held import Held

IDS_FILE = "trackers.json"
# the tracker's name -> the package it needs (the extra of the same name installs it)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Tracker(Protocol):
    """One experiment tracker's run, started once per process (a resume starts it again with the stored id)."""

    name: str  # the name log.trackers gives it
    durable: bool  # a ``log`` that returned is stored (else only a ``close`` that returned stores what it was sent)

    def start(self, config: dict, run_dir: Path, resume_id: str | None, held: dict) -> str | None:
        """Open (or, given ``resume_id``, continue) the run; record ``config``. Returns the id to store, or None.

        ``held``: the tracker's entry in ``RUN_DIR/tracked.json`` (``held.Held``): its run holds every round up to
        ``held["through"]`` once and, where ``held.get("stale")``, maybe later rounds a resume redid. ``start`` drops
        those later rounds from what the run shows (or starts a run without them) and leaves in ``held["through"]``
        the round up to which the run it continues holds the record; the caller then sends it the rounds after it.
        """
        ...

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record finite scalars at rollout round ``step`` (0: the base policy's evaluation)."""
        ...

    def log_artifact(self, path: Path) -> None:
        """Attach a file (the final plot)."""
        ...

    def log_rounds(self, rounds: list[tuple[int, dict[str, float]]]) -> None:
        """``log`` each ``(round, metrics)`` in order: a resume's backfill (MLflow sends them in few calls)."""
        ...

    def log_samples(self, rows: list[dict], round_: int, split: str) -> None:
        """Record sample completions of round ``round_``: ``rows`` are their ``samples.jsonl`` lines (``round``,
        ``split``, prompt, completion, reward, reference, behaviour log-prob sum); ``split``: ``train`` or
        ``heldout``. W&B: a table, MLflow: a JSON artifact, TensorBoard: markdown text."""
        ...

    def close(self, failed: bool = False) -> None:
        """End this process's part of the run; ``failed``: it ended on an exception or Ctrl-C."""
        ...


def require_trackers(names: list[str]) -> None:
    """Check before any work that every named tracker's package is installed.

    Raises:
        UserError: a tracker whose package is missing; the message names the extra that installs it.
    """
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"log.trackers names {name}, but the {PACKAGES[name]} package is not installed: "
                            f"pip install 'trustbatch[{name}]', or remove {name} from log.trackers")


def check_trackers(names: list[str], mlflow_uri: str | None = None, run_dir: Path | None = None) -> None:
    """Check before any model loads what would stop the named trackers at start: their packages
    (``require_trackers``), MLflow's tracking store (opened, as a run opens it) and W&B's login when it runs online.

    Raises:
        UserError: a missing package, an MLflow store that cannot be used (an unknown scheme, a path that cannot be
            written), ``WANDB_MODE=online`` with no API key; one line naming the setting and the fix.
    """
    require_trackers(names)
    if "mlflow" in names:
        from .mlflow import check_store

        check_store(mlflow_uri, run_dir)
    if "wandb" in names:
        from .wandb import check_login

        check_login()


def stored_ids(run_dir: Path) -> dict[str, str]:
    """``RUN_DIR/trackers.json``: the id of each tracker's run ({} if none was stored)."""
    path = Path(run_dir) / IDS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def open_trackers(names: list[str], run_dir: Path, config: dict, *, resuming: bool,
                  mlflow_uri: str | None = None, held: Held | None = None) -> list[Tracker]:
    """Start the named trackers for ``run_dir``; on a resume, continue the runs whose ids ``trackers.json`` holds.

    ``config``: the resolved configuration as plain data (``Config.model_dump(mode="json")``); ``mlflow_uri``: the
    MLflow tracking store (None: ``MLFLOW_TRACKING_URI``, else MLflow's default); ``held``: what each tracker's run
    holds (``RUN_DIR/tracked.json``; None: nothing known, each run taken to hold nothing it must drop).

    Raises:
        UserError: a named tracker whose package is not installed (``require_trackers``).
    """
    require_trackers(names)
    path = Path(run_dir) / IDS_FILE
    ids = stored_ids(run_dir) if resuming else {}
    held = Held(run_dir, fresh=True) if held is None else held
    opened = []
    try:
        for name in dict.fromkeys(names):
            tracker = _make(name, mlflow_uri)
            with kept_random():
                ids[name] = tracker.start(config, Path(run_dir), ids.get(name), held.entry(name))
            opened.append(tracker)
    except BaseException:
        for tracker in opened:
            with kept_random():
                tracker.close(failed=True)
        raise
    stored = {k: v for k, v in ids.items() if v is not None}
    if stored or path.exists():
        atomic_write(path, json.dumps(stored, indent=2))
    return opened


def _make(name: str, mlflow_uri: str | None) -> Tracker:
    if name == "tensorboard":
        from .tensorboard import TensorBoardTracker

        return TensorBoardTracker()
    if name == "wandb":
        from .wandb import WandbTracker

        return WandbTracker()
    from .mlflow import MlflowTracker

    return MlflowTracker(mlflow_uri)


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics record, as floats (strings, lists, NaN and ±inf are not plotted)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


@contextlib.contextmanager
def kept_random():
    """Python's global random state, as it was before the block: the trackers' clients draw ids from it (W&B's
    request ids), and a checkpoint stores it, so a run with trackers must leave it where a run without them does."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)
