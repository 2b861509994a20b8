"""TensorBoard: scalars as event files in ``RUN_DIR/tensorboard`` (a resume adds an event file beside the first)."""

from __future__ import annotations

from pathlib import Path


class TensorBoardTracker:
    """``torch.utils.tensorboard``'s writer; TensorBoard has no run id and shows no artifacts."""

    def __init__(self):
        self._writer = None

    def start(self, config: dict, run_dir: Path, resume_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def log_artifact(self, path: Path) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()
