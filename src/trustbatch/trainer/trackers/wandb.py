"""Weights & Biases: offline unless configured; the run directory's run continues on ``--resume``.

Without ``WANDB_MODE`` or ``WANDB_API_KEY`` the run is written offline, in ``RUN_DIR/wandb/offline-run-*`` (one
folder per process start); ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later, the folders of a resumed
run in order into the same run. Each round's metrics are logged against a ``round`` axis rather than W&B's own
``_step``, which a resumed offline run restarts at 0.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_KEY = "round"


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
