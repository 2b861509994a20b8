"""Single-sample KL estimators at the sampled token (Schulman, http://joschu.net/blog/kl-approx.html).

All take ``log_ratio`` = log π_θ(y_t) − log π_other(y_t), shape [B, T], with gradient through π_θ,
and return a per-token value of the same shape. With x = log_ratio and r = π_other/π_θ = e^{−x}:

- ``k1`` = −log r = x. Unbiased for KL(π_θ‖π_other) on π_θ samples; can be negative.
- ``k2`` = ½ (log r)² = ½ x². Biased (second order), ≥ 0; gradient x·∇log π_θ.
- ``k3`` = (r − 1) − log r = e^{−x} − 1 + x. ≥ 0. The estimator of the P3O reference code
  (FeynRL algs/RL/common.py ``compute_kl_distance``) and of GRPO's reference KL (arXiv 2402.03300).
  On samples from π_b its expectation is χ²(π_b‖π_θ) − KL(π_b‖π_θ), and its gradient is
  (1 − 1/ρ)·∇log π_θ (docs/objectives.md §1.3, §5).

Callers clamp ``log_ratio`` first (see ``log_ratio_clip``), which makes the k3 gradient 0, not
reversed, beyond the bound (the reference's ±10 exponent clamp reverses it; docs §1.3 item 3).
"""

from __future__ import annotations

import torch


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio * log_ratio


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision near log_ratio = 0, where the value is ~x²/2.
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` by name; raises ValueError for an unknown name."""
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}") from None
    return fn(log_ratio)
