"""The report's figures (matplotlib, imported where a figure is drawn): curves and per-step traces over seeds,
ratio histograms, within-round steps, replayed rounds' ratio spread and the dose–response plot, each written as a
small palette PNG whose file name the Markdown links."""

from __future__ import annotations

import math
from pathlib import Path

from ..experiment import family_and_dose
from .runs import histogram_quantile, mean_se, series, step_histograms, trace_series, within_round
from .tables import WITHIN_KEYS


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _smooth(xs: list[float], w: int = 5) -> list[float]:
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


# Colours a figure is reduced to: the plots draw at most 8 series colours plus their anti-aliased edges, and a
# 64-colour palette PNG is about a quarter of matplotlib's RGBA one (issue 38 item 5: committed reports stay small).
PALETTE = 64


def _save(fig, out: Path, fname: str) -> str:
    """Lay out, write ``out/fname`` as a ``PALETTE``-colour PNG and free ``fig``; returns ``fname`` for the Markdown link."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    Image.open(buf).convert("RGB").quantize(PALETTE).save(out / fname, optimize=True)
    return fname


def experiment_figures(name: str, arms: dict[str, list[dict]], out: Path, *, draw: bool = True) -> list[str]:
    """Write one experiment's figures into ``out`` (curves, per-step traces, ratio histograms; for replayed arms the
    step-ratio and within-round figures) and return their file names, in the order the section links them
    (``draw=False``: the names alone, nothing written)."""
    if not draw:
        return [f"{name}_{tag}.png" for tag in ("curves", "traces", "ratios")] + _replay_figures(name, arms, out, draw=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    panels = [
        ("curves", [("reward_mean", "training reward (5-step mean)", True), ("heldout_accuracy", "held-out pass@1", False)]),
        ("traces", [("ess", "normalized ESS of π/μ", False), ("cap_fraction", "P3O cap share (tokens)", False),
                    ("cap_weight_removed", "P3O cap: share of |A|·ρ removed", False),
                    ("kl_weight", "P3O KL weight", False), ("grpo_zeroed_0.2", "share GRPO(ε=0.2) would zero", False),
                    ("grad_norm", "gradient norm", False), ("staleness_mean", "mean sample age (versions)", False)]),
    ]
    for tag, keys in panels:
        fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * min(len(keys), 3), 3.0) if len(keys) < 4 else (2.4 * len(keys), 3.0), dpi=80)
        for ax, (key, label, smooth) in zip(axes, keys):
            for i, (arm, runs) in enumerate(arms.items()):
                steps, mean, se = (trace_series if tag == "traces" else series)(runs, key)
                if not steps:
                    continue
                if smooth:
                    mean, se = _smooth(mean), _smooth(se)
                c = COLORS[i % len(COLORS)]
                ax.plot(steps, mean, color=c, label=arm, lw=1.0 if tag == "traces" else 1.4,
                        marker="o" if key.startswith("heldout") else None, ms=3)
                ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], color=c, alpha=0.2)
            ax.set_xlabel("optimizer step" if tag == "traces" else "rollout round")
            ax.set_title(label, fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        _legend(*axes, fontsize=7)
        fig.suptitle(f"{name}: mean ± s.e. over seeds", fontsize=9)
        files.append(_save(fig, out, f"{name}_{tag}.png"))
    # token log-ratio histograms at the first and the last recorded round, summed over seeds
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.0), dpi=80)
    for ax, pick, title in ((axes[0], min, "first round"), (axes[1], max, "last round")):
        for i, (arm, runs) in enumerate(arms.items()):
            recs = [r for run in runs for r in run["ratios"] if "opt_step" not in r]
            if not recs:
                continue
            step = pick(r["step"] for r in recs)
            chosen = [r for r in recs if r["step"] == step]
            counts = [sum(c) for c in zip(*(r["counts"] for r in chosen))]
            edges = chosen[0]["edges"]
            total = sum(counts) or 1
            ax.step(edges[:-1], [c / total for c in counts], where="post", color=COLORS[i % len(COLORS)], label=arm, lw=1.2)
        ax.set_yscale("log")
        ax.set_xlabel("log π_θ/μ per token (clamped to ±2)")
        ax.set_title(f"ratio histogram, {title}", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    _legend(*axes, fontsize=7)
    files.append(_save(fig, out, f"{name}_ratios.png"))
    return files + _replay_figures(name, arms, out, draw=True)


def _legend(*axes, **kw) -> None:
    """The arms' legend on the first of ``axes`` with labelled artists; none when no panel has data (matplotlib would
    warn): runs without ratio records, or a panel whose metric the runs never logged."""
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**kw)
            return


def _replay_figures(name: str, arms: dict[str, list[dict]], out: Path, *, draw: bool) -> list[str]:
    """The step-ratio and within-round figures of replayed arms (none without them)."""
    return [f for f in (step_ratio_figure(name, arms, out, draw=draw), within_round_figure(name, arms, out, draw=draw)) if f]


def within_round_figure(name: str, arms: dict[str, list[dict]], out: Path, *, draw: bool = True) -> str | None:
    """ESS, clip share, KL weight and gradient norm against the step index within a round, for multi-step arms
    (``draw=False``: the file name alone)."""
    multi = {arm: runs for arm, runs in arms.items() if len(within_round(runs, "ess")[0]) > 1}
    if not multi or not draw:
        return f"{name}_within_round.png" if multi else None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WITHIN_KEYS), figsize=(2.6 * len(WITHIN_KEYS), 3.0), dpi=80)
    for ax, (key, label, _) in zip(axes, WITHIN_KEYS):
        for i, (arm, runs) in enumerate(arms.items()):
            if arm not in multi:
                continue
            js, mean, se = within_round(runs, key)
            c = COLORS[i % len(COLORS)]
            ax.errorbar(js, mean, yerr=se, color=c, label=arm, marker="o", ms=3, lw=1.2, capsize=2)
        ax.set_xlabel("optimizer step within the round")
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: within a round, mean over rounds, ± s.e. over seeds", fontsize=9)
    return _save(fig, out, f"{name}_within_round.png")


def step_ratio_figure(name: str, arms: dict[str, list[dict]], out: Path, *, draw: bool = True) -> str | None:
    """Replayed rounds: the spread of log π_θ/μ over each optimizer step's mini-batch, against the step's index
    within its round (records of every recorded round and seed pooled), one line per arm; None when no arm
    takes more than one optimizer step per round (``draw=False``: the file name alone)."""
    per_arm = step_histograms(arms)
    if not per_arm or not draw:
        return f"{name}_step_ratios.png" if per_arm else None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 1, figsize=(6.5, 3.2), dpi=80)
    for i, (arm, (edges, by_step)) in enumerate(per_arm.items()):
        xs = list(by_step)
        q = {p: [histogram_quantile(edges, by_step[x], p) for x in xs] for p in (0.05, 0.5, 0.95)}
        c = COLORS[list(arms).index(arm) % len(COLORS)]
        ax.plot(xs, q[0.5], color=c, marker="o", ms=3, lw=1.2, label=arm)
        ax.fill_between(xs, q[0.05], q[0.95], color=c, alpha=0.15)
    ax.set_xlabel("optimizer step within the round (0 = on the fresh batch)")
    ax.set_ylabel("log π_θ/μ per token")
    ax.set_title(f"{name}: median and 5–95% of the ratios each optimizer step trains on", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, f"{name}_step_ratios.png")


def dose_figure(name: str, scored: dict[str, tuple[dict, dict, dict]], out: Path, *, draw: bool = True) -> str | None:
    """Primary score and collapses against shift strength, one line per objective family (``draw=False``: the file
    name alone)."""
    doses: list[str] = []
    fams: dict[str, dict[str, tuple[float, float, int, int]]] = {}
    ref = None
    for arm, (sc, col, _) in scored.items():
        fam, dose = family_and_dose(arm)
        m, se = mean_se(list(sc.values()))
        n_col = sum(1 for v in col.values() if v)
        if dose is None:
            ref = (fam, m, se)
            continue
        if dose not in doses:
            doses.append(dose)
        fams.setdefault(fam, {})[dose] = (m, se, n_col, len(col))
    if not doses or not draw:
        return f"{name}_dose.png" if doses else None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    x = {d: i for i, d in enumerate(doses)}
    for i, (fam, pts) in enumerate(fams.items()):
        c = COLORS[i % len(COLORS)]
        ds = [d for d in doses if d in pts]
        axes[0].errorbar([x[d] + 0.04 * i for d in ds], [pts[d][0] for d in ds], yerr=[pts[d][1] for d in ds],
                         color=c, marker="o", ms=4, capsize=3, label=fam)
        axes[1].plot([x[d] + 0.04 * i for d in ds], [pts[d][2] / max(1, pts[d][3]) for d in ds], color=c, marker="o", ms=4, label=fam)
    if ref is not None and math.isfinite(ref[1]):
        axes[0].axhline(ref[1], color="k", ls="--", lw=1, label=f"{ref[0]} (no shift)")
    for ax, title in ((axes[0], "primary score (held-out pass@1, mean of last two evals) ± s.e."),
                      (axes[1], "fraction of seeds collapsed")):
        ax.set_xticks(range(len(doses)), doses, fontsize=8)
        ax.set_xlabel("shift strength")
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: dose–response", fontsize=9)
    return _save(fig, out, f"{name}_dose.png")
