"""Run-directory output: metrics as JSONL and TensorBoard events, the final plot (file records: ``records``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..records import atomic_write, truncate_records


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` and mirrors scalars to TensorBoard; an evaluation's
    sample completions go to ``samples.jsonl`` and TensorBoard text.

    ``enabled=False`` (data-parallel ranks other than 0) writes nothing.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if tensorboard and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` and any torn last line (used on resume)."""
        if self.enabled:
            truncate_records(self.path, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Append one line per sample (``{"step", "prompt", "completion", "reward"}``) to ``samples.jsonl``, and the
        evaluation's samples as one TensorBoard text (tag ``samples``) at ``step``."""
        if not self.enabled or not samples:
            return
        with open(self.path.parent / "samples.jsonl", "a") as f:
            for smp in samples:
                f.write(json.dumps({"step": step, **smp}) + "\n")
            f.flush()
        if self._tb is not None:
            # markdown: TensorBoard's text plugin renders it; the fences keep a completion's own characters
            text = "\n\n".join(f"**reward {smp['reward']:g}**\n\n```\n{smp['prompt']}{smp['completion']}\n```"
                                for smp in samples)
            self._tb.add_text("samples", text, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
        if key == "ess":
            # ESS lives in [0, 1]; matplotlib's autoscale would draw 1 − 1e-12 jitter at an offset scale
            ax.set_ylim(0.0, 1.02)
            ax.ticklabel_format(axis="y", useOffset=False)
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


def log_step_records(run_dir: Path, step: int, records: list[dict]) -> None:
    """Append one line per optimizer step of a replayed round to ``steps.jsonl``.

    ``records``: the learner's ``step_records`` (each step's metrics: ESS, cap share, KL weight, the shares
    GRPO's clip would zero, gradient norm, ..., with ``opt_step``, ``epoch`` and ``minibatch``). Each line gets
    ``step`` (the rollout round), so ``truncate_records`` drops a redone round's steps on resume. The round's
    line in ``metrics.jsonl`` is their mean; this file keeps what the mean hides, how a batch drifts as it
    is replayed (issue 14's per-step traces).
    """
    with open(Path(run_dir) / "steps.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps({"step": step, **r}) + "\n")
        f.flush()


def log_ratio_histogram(run_dir: Path, step: int, log_ratio, mask=None, **fields) -> None:
    """Append a histogram of token log-ratios log π_θ/μ to ``ratios.jsonl``.

    A record without ``opt_step`` is the round's batch before its update; one with ``opt_step``, ``epoch``
    and ``minibatch`` (``fields``) is the mini-batch of that optimizer step of a replayed round, before it.

    log_ratio: ``[B, C]`` with ``mask`` ``[B, C]`` (bool), or ``[N]`` valid tokens when ``mask`` is None;
    80 bins on [−2, 2] (values beyond are put in the end bins). The record also holds the exact 5%, 50% and
    95% quantiles of the unclamped log-ratios (``quantiles``, linear interpolation as ``numpy.percentile``):
    the bins are 0.05 wide, too coarse to tell an on-policy step (|log ρ| ~ 1e-7) from a shifted one.
    """
    import torch

    edges = torch.linspace(-2.0, 2.0, 81)
    raw = (log_ratio if mask is None else log_ratio[mask]).detach().double().flatten()
    counts = torch.histc(raw.float().clamp(-2.0, 2.0), bins=80, min=-2.0, max=2.0)
    rec = {"step": step, **fields, "edges": [round(e, 4) for e in edges.tolist()],
           "counts": [int(c) for c in counts.tolist()]}
    if raw.numel():
        ordered = raw.sort().values
        rec["quantiles"] = {str(q): _quantile(ordered, q) for q in (0.05, 0.5, 0.95)}
    with open(Path(run_dir) / "ratios.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def _quantile(sorted_x, q: float) -> float:
    """The q-quantile of an ascending 1-D tensor, linear between order statistics (``numpy.percentile``'s
    default); torch.quantile refuses inputs over 2**24 elements, a large batch's token count."""
    pos = q * (sorted_x.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, sorted_x.numel() - 1)
    return float(sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo))
