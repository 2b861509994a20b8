"""Train/inference mismatch corrections that compose with the clipped objectives (docs/objectives.md §3.9).

The weight compares the trainer's log-probs at the rollout's parameters (π_learner(θ_old), passed as
``old_logprobs``) with the inference engine's (μ, ``behavior_logprobs``): k = π_learner/μ.

- ``tis_token``: w_t = min(k_t, cap)                        (TIS, Yao et al. 2025; cap 2 as verl/slime)
- ``tis_sequence``: w_i = min(k_i, cap) on every token of sequence i
- ``mis_token``: w_t = 1 if low ≤ k_t ≤ high else 0          (IcePop, arXiv 2510.18855; band [0.5, 5])
- ``mis_sequence``: w_i = k_i if k_i ≤ cap else 0             (sequence rejection, arXiv 2510.26788 §4)

Sequence level uses k_i = exp(mean_t log k_t) (the geometric mean) by default, or the product
exp(Σ_t log k_t) with ``seq_reduce="sum"``. All weights are detached.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("tis_token", "tis_sequence", "mis_token", "mis_sequence")


def correction_weights(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    *,
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 5.0),
    seq_reduce: str = "mean",
    log_ratio_clip: float = 20.0,
) -> tuple[torch.Tensor, dict]:
    """Detached per-token weights ``[B, T]`` (0 at masked positions) and metrics.

    old_logprobs, behavior_logprobs: [B, T], already zeroed at masked positions; mask: [B, T] bool.
    Metrics: ``correction_weight_mean`` and ``correction_zeroed`` (fraction of valid tokens given weight 0)
    or ``correction_capped`` (fraction whose weight hit the cap).

    Raises:
        ValueError: unknown ``kind`` or ``seq_reduce``, or a band with low > high.
    """
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown correction {kind!r}; choose one of {CORRECTIONS}")
    if seq_reduce not in ("mean", "sum"):
        raise ValueError(f"seq_reduce={seq_reduce!r} must be 'mean' (geometric mean) or 'sum' (product)")
    low, high = band
    if low > high:
        raise ValueError(f"correction band {band} has low > high")
    m = mask
    mf = m.to(old_logprobs.dtype)
    lk = torch.where(m, old_logprobs.detach() - behavior_logprobs.detach(), 0.0)
    if kind.endswith("sequence"):
        s = lk.sum(1)
        if seq_reduce == "mean":
            s = s / mf.sum(1).clamp_min(1.0)
        lk = s[:, None].expand_as(lk)
    k = lk.clamp(-log_ratio_clip, log_ratio_clip).exp()
    n = mf.sum().clamp_min(1.0)
    metrics = {}
    if kind.startswith("tis"):
        w = k.clamp(max=cap)
        metrics["correction_capped"] = ((k > cap) & m).sum() / n
    elif kind == "mis_token":
        keep = (k >= low) & (k <= high)
        w = keep.to(k.dtype)
        metrics["correction_zeroed"] = (~keep & m).sum() / n
    else:
        keep = k <= cap
        w = torch.where(keep, k, 0.0)
        metrics["correction_zeroed"] = (~keep & m).sum() / n
    w = torch.where(m, w, 0.0)
    metrics["correction_weight_mean"] = (w * mf).sum() / n
    return w, metrics
