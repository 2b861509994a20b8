"""Run-directory output: metrics as JSONL and TensorBoard events, atomic file writes, the final plot."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, then rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` and any torn last line (used on resume)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                keep.append(line)
        atomic_write(self.path, "".join(k + "\n" for k in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        rec = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def plot_run(records: list[dict], path: Path, title: str = "") -> None:
    """PNG with reward, held-out accuracy and ESS against the rollout round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, label in zip(axes, ["reward_mean", "heldout_accuracy", "ess"],
                              ["train reward (mean)", "held-out accuracy (pass@1, T=1)", "batch ESS"]):
        x, y = series(key)
        ax.plot(x, y, marker="o" if key == "heldout_accuracy" else None, lw=1.2)
        if key == "heldout_accuracy":
            gx, gy = series("heldout_greedy_accuracy")
            ax.plot(gx, gy, marker="s", lw=1.0, ls="--", label="greedy")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("rollout round")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
