"""Weights & Biases: offline unless configured; the run directory's run continues on ``--resume``.

Without ``WANDB_MODE`` or ``WANDB_API_KEY`` the run is written offline, in ``RUN_DIR/wandb/offline-run-*`` (one
folder per process start); ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later, the folders of a resumed
run in order into the same run. Each round's metrics are logged against a ``round`` axis rather than W&B's own
``_step``, which a resumed offline run restarts at 0.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

STEP_KEY = "round"


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

    def __init__(self):
        self.run = None

    def start(self, config: dict, run_dir: Path, resume_id: str | None) -> str:
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
        return self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, STEP_KEY: step})

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass  # the samples are in samples.jsonl; a text per evaluation would clutter this tracker's run

    def log_artifact(self, path: Path) -> None:
        import wandb

        # artifact names: letters, digits, '-', '_', '.'
        name = re.sub(r"[^\w.\-]", "_", f"{self.run.id}-{Path(path).stem}")
        artifact = wandb.Artifact(name, type="run-output")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
