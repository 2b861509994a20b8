"""TensorBoard: scalars as event files in ``RUN_DIR/tensorboard`` (a resume adds an event file beside the first).

Each start's event file begins with TensorBoard's purge mark (``SummaryWriter(purge_step=...)``, a ``SessionLog``
START) at the round after the last one the earlier files hold as ``metrics.jsonl`` does: TensorBoard's readers then
drop every earlier event from that round on, so a round the killed run had logged and the resume redid shows once,
with the resume's values. (TensorBoard's Rust data server instead drops, per tag, the points at or after a step
logged again: the rounds a resume sends again have the same effect there.)
"""

from __future__ import annotations

import threading
from pathlib import Path


def _quiet_writer_thread() -> None:
    """Keep TensorBoard's writer thread from printing the traceback of a write the disk refused: the writer keeps the
    error and raises it again in the main thread at the next ``flush``, where the run ends on one line (a full disk);
    the thread's own print split that line. Installed once; every other thread's error is printed as before."""
    previous = threading.excepthook
    if getattr(previous, "trustbatch_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.trustbatch_tensorboard = True
    threading.excepthook = hook


class TensorBoardTracker:
    """``torch.utils.tensorboard``'s writer; TensorBoard has no run id and shows no artifacts."""

    name = "tensorboard"
    durable = True  # each log flushes the event file

    def __init__(self):
        self._writer = None

    def start(self, config: dict, run_dir: Path, resume_id: str | None, held: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_thread()
        # the purge mark hides the earlier files' events from round through + 1 on; a new run's file starts with one
        # too (at 0, hiding nothing): TensorBoard's server takes a run's first mark for its start, not a restart
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=held["through"] + 1)
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

    def log_samples(self, rows: list[dict], round_: int, split: str) -> None:
        # markdown: TensorBoard's text plugin renders it; the fences keep a completion's own characters
        text = "\n\n".join(f"**reward {r['reward']:g}** · reference `{r['reference']}` · behaviour log-prob "
                             f"{r['behaviour_logprob_sum']:.3f}\n\n```\n{r['prompt']}{r['completion']}\n```"
                             for r in rows)
        self._writer.add_text(f"samples/{split}", text, round_)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()
