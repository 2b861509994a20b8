"""TensorBoard: scalars as event files in ``RUN_DIR/tensorboard`` (a resume adds an event file beside the first).

A resume's event file starts with TensorBoard's purge mark (``SummaryWriter(purge_step=...)``) at the round after the
last one the earlier files hold as ``metrics.jsonl`` does: TensorBoard's readers then drop every earlier event from
that round on, so a round the killed run had logged and the resume redid shows once, with the resume's values.
"""

from __future__ import annotations

from pathlib import Path


class TensorBoardTracker:
    """``torch.utils.tensorboard``'s writer; TensorBoard has no run id and shows no artifacts."""

    name = "tensorboard"
    durable = True  # each log flushes the event file

    def __init__(self):
        self._writer = None

    def start(self, config: dict, run_dir: Path, resume_id: str | None, held: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(run_dir) / "tensorboard"
        # the purge mark hides the earlier files' events from round through + 1 on (nothing there: it hides nothing)
        purge = held["through"] + 1 if folder.is_dir() and any(folder.iterdir()) else None
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        held.pop("stale", None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def log_rounds(self, rounds: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in rounds:
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
