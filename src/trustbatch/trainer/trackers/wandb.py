"""Weights & Biases: offline unless configured; the run directory's run continues on ``--resume``.

Without ``WANDB_MODE`` or ``WANDB_API_KEY`` the run is written offline, in ``RUN_DIR/wandb/offline-run-*`` (one
folder per process start); ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later, the folders of a resumed
run in order into the same run. Each round's metrics are logged against a ``round`` axis rather than W&B's own
``_step``, which a resumed offline run restarts at 0.

W&B writes a run folder's records out in blocks, all of them only when ``finish`` returns: a process killed before
leaves a folder that holds some of the rounds it was sent, or none. So ``RUN_DIR/tracked.json`` lists the offline
folders that finished, with the rounds each holds, and a resume moves to ``RUN_DIR/wandb-superseded/`` every folder
that did not finish or holds a round the resume redoes (a Ctrl-C'd run's rounds after its last checkpoint); the
resumed folder is then sent every round of ``metrics.jsonl`` the folders left hold not. An online run streams its
rounds to W&B's server as they come and is continued from the checkpoint (W&B's history cannot be cut back).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

STEP_KEY = "round"
SUPERSEDED = "wandb-superseded"  # RUN_DIR/wandb-superseded: offline folders a resume took out of RUN_DIR/wandb


def check_login() -> None:
    """Before any model loads: an online run (``WANDB_MODE`` set to other than offline, dryrun or disabled, and no
    ``WANDB_API_KEY``) needs a stored login (``wandb login``) unless W&B can ask for one at a terminal.

    Raises:
        UserError: W&B would stop at ``wandb.init`` with "No API key configured", or on a stored key of the wrong
            form.
    """
    mode = os.environ.get("WANDB_MODE")
    if not mode or os.environ.get("WANDB_API_KEY") or mode in ("offline", "dryrun", "disabled") or _terminal():
        return
    import wandb

    try:  # W&B's own lookup (environment, netrc, its settings file), without a prompt or a network call
        from wandb.sdk.lib.wbauth.authenticate import authenticate_session
    except ImportError:  # another W&B than the pinned one: wandb.init will say it
        return
    from ...errors import UserError

    host = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
    try:
        found = authenticate_session(host=host, source="trustbatch", prompt=False, update_session=False)
    except wandb.errors.AuthenticationError as e:  # a key of the wrong form: wandb.init refuses it the same way
        raise UserError(f"log.trackers names wandb and WANDB_MODE={mode}, but W&B's login for {host} cannot be "
                        f"used ({e}); run `wandb login` again or set WANDB_API_KEY") from None
    if found is None:
        raise UserError(f"log.trackers names wandb and WANDB_MODE={mode}, but no W&B API key is configured for "
                        f"{host}: set WANDB_API_KEY or run `wandb login`, or unset WANDB_MODE to log offline")


def _terminal() -> bool:
    """Whether W&B may ask for a key at a terminal (stdin may be closed or absent in a service)."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


class WandbTracker:
    """A ``wandb`` run named after the run directory, in project ``WANDB_PROJECT`` (default ``trustbatch``)."""

    name = "wandb"

    def __init__(self):
        self.run = None
        self.durable = True  # offline: False once started (a folder holds what it was sent only once finished)
        self._held: dict = {}
        self._first = self._last = -1  # the first and last round this process sent

    def start(self, config: dict, run_dir: Path, resume_id: str | None, held: dict) -> str:
        import wandb

        configured = os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")
        # console="off": the trainer's output stays as it is (W&B would wrap stdout and stderr); quiet: no history summary
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "trustbatch"), name=Path(run_dir).name,
                              dir=str(run_dir), id=resume_id, resume="allow", mode=None if configured else "offline",
                              settings=wandb.Settings(console="off", quiet=True))
        # a resume may change train.steps and the reporting keys: the config holds the latest values
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.durable = not self.run.offline
        if self.run.offline:
            held["through"] = keep_finished(Path(run_dir), held.setdefault("folders", {}), held["through"],
                                            Path(self.run.settings.sync_dir).name)
        held.pop("stale", None)
        self._held, self._first, self._last = held, held["through"] + 1, held["through"]
        return self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._last = max(self._last, step)  # sent, or maybe: a folder that may hold it counts it (keep_finished)
        self.run.log({**metrics, STEP_KEY: step})

    def log_rounds(self, rounds: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in rounds:
            self.log(metrics, step)

    def log_samples(self, rows: list[dict], round_: int, split: str) -> None:
        import wandb

        self._last = max(self._last, round_)
        # one row of its own, at the round: W&B stores the table as a file in the run folder (media/table/samples)
        table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows], allow_mixed_types=True)
        self.run.log({f"samples/{split}": table, STEP_KEY: round_})

    def log_artifact(self, path: Path) -> None:
        import wandb

        # artifact names: letters, digits, '-', '_', '.'
        name = re.sub(r"[^\w.\-]", "_", f"{self.run.id}-{Path(path).stem}")
        artifact = wandb.Artifact(name, type="run-output")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        if self.run.offline:  # finished: the folder holds every round it was sent
            self._held["folders"][Path(self.run.settings.sync_dir).name] = [self._first, self._last]
            self._held["through"] = self._last


def keep_finished(run_dir: Path, folders: dict[str, list[int]], limit: int, current: str) -> int:
    """Move out of ``RUN_DIR/wandb`` (to ``RUN_DIR/wandb-superseded``) every offline folder of the run but
    ``current`` that did not finish or holds a round after ``limit`` (``tracked.json``'s ``through``, cut back to the
    checkpoint a resume starts from). ``folders``: the finished ones, ``{name: [first round, last round]}``, left with
    those kept. Returns the last round the kept folders hold (every round up to it once; -1: none).
    """
    through, keep = -1, {}
    for name, (first, last) in sorted(folders.items(), key=lambda f: f[1]):
        # each start sends the rounds after the kept folders' last: a chain of ranges (a folder sent none holds none)
        if first == through + 1 and through <= last <= limit and (run_dir / "wandb" / name).is_dir():
            keep[name], through = [first, last], last
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        if folder.name not in keep and folder.name != current:
            (run_dir / SUPERSEDED).mkdir(exist_ok=True)
            shutil.move(str(folder), str(run_dir / SUPERSEDED / folder.name))
    folders.clear()
    folders.update(keep)
    return through
