"""Run-directory output: metrics as JSONL, mirrored to the experiment trackers; the final plot (file records: ``records``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..records import atomic_write, iter_metrics, truncate_records
from .trackers import kept_random, open_trackers, scalars, stored_ids
from .trackers.held import Held


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` and mirrors its finite scalars to the trackers; sample
    completions (``log.samples``) go to ``samples.jsonl`` and to the trackers.

    ``metrics.jsonl`` is the record: a tracker is sent a round only once the file holds it. ``trackers``: started
    ``trackers.Tracker`` runs (``open`` starts them, or ``trackers.open_trackers``), closed by ``close``; ``held``:
    what each holds (``RUN_DIR/tracked.json``; None: not kept). ``enabled=False`` (data-parallel ranks other than 0)
    writes nothing.
    """

    def __init__(self, run_dir: Path, trackers: list = (), enabled: bool = True, held: Held | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.trackers = list(trackers) if enabled else []
        self.held = held if enabled else None
        self._sent = -1  # the last round every tracker returned from (tracked.json's through at a checkpoint, the end)

    @classmethod
    def open(cls, run_dir: Path, names: list[str], config: dict, *, resume_round: int | None,
             mlflow_uri: str | None = None) -> MetricsLog:
        """The run's log with the trackers ``names`` started and made to agree with ``metrics.jsonl``.

        ``resume_round``: None for a new run; on a resume, the round of the checkpoint it starts from (-1: none).
        ``metrics.jsonl`` and ``samples.jsonl`` are cut back to it (the rounds after are redone), each tracker drops
        what it holds after the last round it holds as the record does (``Tracker.start``), and is sent the rounds
        of the record it then lacks, samples included, before the first new round.

        Raises:
            UserError: a tracker whose package is not installed.
        """
        log = cls(run_dir)
        resuming = resume_round is not None
        held = Held(run_dir, fresh=not resuming)
        if resuming:
            # a round's samples reach the trackers before its metrics line: the last round sent is the later of both
            sent = [r.get("step", 0) for r in iter_metrics(log.path)] if log.path.exists() else []
            sent += [r.get("round", 0) for r in iter_metrics(log.samples_path)] if log.samples_path.exists() else []
            last = max(sent, default=-1)
            held.redo_after(resume_round, last, stored_ids(run_dir))
            if held.data or held.path.exists():  # on disk before the records that show it are cut
                held.save()
            log.truncate_after(resume_round)
        log.trackers = open_trackers(names, run_dir, config, resuming=resuming, mlflow_uri=mlflow_uri, held=held)
        log.held = held
        log._sent = min((held.entry(t.name)["through"] for t in log.trackers), default=-1)
        try:
            held.opened([t.name for t in log.trackers])
            if resuming:
                log._backfill(resume_round)
        except BaseException:
            log.close(failed=True)
            raise
        return log

    def _backfill(self, upto: int) -> None:
        """Send each tracker the records up to round ``upto`` after the last it holds (``tracked.json``): each round's
        samples (``samples.jsonl``), then the rounds' metrics."""
        records = [r for r in iter_metrics(self.path) if r.get("step", 0) <= upto] if self.path.exists() else []
        samples: dict[tuple[int, str], list[dict]] = {}
        for row in iter_metrics(self.samples_path) if self.samples_path.exists() else ():
            row = {"round": row.pop("round", row.pop("step", 0)), "split": row.pop("split", "heldout"), **row}
            samples.setdefault((row["round"], row["split"]), []).append(row)
        for tracker in self.trackers:
            after = self.held.entry(tracker.name)["through"]
            with kept_random():
                for (round_, split), rows in sorted(samples.items()):
                    if after < round_ <= upto:
                        tracker.log_samples(rows, round_, split)
                tracker.log_rounds([(r["step"], scalars({k: v for k, v in r.items() if k != "step"}))
                                    for r in records if r.get("step", 0) > after])
        self._sent = upto
        self.held.advance(upto, [t.name for t in self.trackers if t.durable])

    def checkpointed(self, round_: int) -> None:
        """The checkpoint of ``round_`` is written: a resume from it finds every tracker holding the rounds up to it
        (they were sent before; ``tracked.json`` says so from here on)."""
        if self.held is not None:
            self.held.advance(min(round_, self._sent), [t.name for t in self.trackers if t.durable])

    @property
    def samples_path(self) -> Path:
        return self.path.parent / "samples.jsonl"

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` and any torn last line of ``metrics.jsonl`` and ``samples.jsonl`` (used on
        resume); trackers keep what they were sent (``open`` makes them agree with the record)."""
        if self.enabled:
            truncate_records(self.path, step)
            truncate_records(self.samples_path, step, key="round")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        values = scalars(metrics)
        with kept_random():
            for tracker in self.trackers:
                tracker.log(values, step)
        self._sent = step

    def log_samples(self, round_: int, split: str, samples: list[dict]) -> None:
        """Append one line per sample to ``samples.jsonl``, ``{"round", "split", **sample}`` (``split``: ``train``
        for a training rollout's, ``heldout`` for an evaluation's; ``eval.sampling.sample_row``'s fields), and send
        the lines to each tracker (``Tracker.log_samples``: a W&B table, an MLflow JSON artifact, TensorBoard text)."""
        if not self.enabled or not samples:
            return
        rows = [{"round": round_, "split": split, **{k: v for k, v in smp.items() if k not in ("round", "split")}}
                for smp in samples]
        with open(self.samples_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
        with kept_random():
            for tracker in self.trackers:
                tracker.log_samples(rows, round_, split)

    def close(self, artifacts: tuple[Path, ...] = (), failed: bool = False) -> None:
        """Attach ``artifacts`` (the final plot) to every tracker and end their runs; once (later calls do nothing).
        ``tracked.json`` then records what each holds (W&B offline: its folder, stored once closed)."""
        trackers, self.trackers = self.trackers, []
        with kept_random():
            for tracker in trackers:
                for path in artifacts:
                    tracker.log_artifact(path)
                tracker.close(failed=failed)
                if self.held is not None:
                    self.held.advance(self._sent, [tracker.name] if tracker.durable else [])
                    self.held.save()


def plot_run(records: list[dict], path: Path, title: str = "", eval_temperature: float = 1.0) -> None:
    """PNG with reward, held-out accuracy (sampled at ``eval_temperature``) and ESS against the rollout round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, label in zip(axes, ["reward_mean", "heldout_accuracy", "ess"],
                              ["train reward (mean)", f"held-out mean reward (T={eval_temperature:g})", "batch ESS"]):
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
