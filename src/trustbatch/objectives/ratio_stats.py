"""Sufficient statistics of the normalized effective sample size (ESS).

ESS(B) = (Σρ)² / (n·Σρ²) over the valid tokens B of a batch (arXiv 2605.12380 Eq. 11 per the
read-through; docs/design/objectives.md §1.1). The three sums add over micro-batches and data-parallel
ranks, so the trainer can compute the ESS of the whole optimizer batch in a no-grad pass before
the first backward, and hand it to the loss of every micro-batch.

Sums are float64, and ρ is cast to float64 *before* squaring (docs/design/objectives.md §1.8 item 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import DEFAULT_LOG_RATIO_CLIP


@dataclass
class RatioStats:
    """Σρ, Σρ² and n over valid tokens, as float64 0-dim tensors on CPU."""

    sum_ratio: torch.Tensor
    sum_sq: torch.Tensor
    count: torch.Tensor

    @classmethod
    def zeros(cls) -> "RatioStats":
        z = torch.zeros((), dtype=torch.float64)
        return cls(z.clone(), z.clone(), z.clone())

    @classmethod
    def from_logprobs(
        cls,
        logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio_clip: float = DEFAULT_LOG_RATIO_CLIP,
    ) -> "RatioStats":
        """Statistics of ρ = exp(clamp(logprobs − behavior_logprobs, ±log_ratio_clip)).

        logprobs, behavior_logprobs: [B, T] (any float dtype; detached here); mask: [B, T] bool or 0/1.
        Masked positions are zeroed before exp, so padding may hold inf or NaN. ρ is computed in the objectives'
        compute dtype (float32, float64 for float64 ``logprobs``), so that both give the same ESS.
        """
        if logprobs.shape != behavior_logprobs.shape or logprobs.shape != mask.shape:
            raise ValueError(
                f"RatioStats needs equal shapes; got logprobs {tuple(logprobs.shape)}, "
                f"behavior_logprobs {tuple(behavior_logprobs.shape)}, mask {tuple(mask.shape)}"
            )
        m = mask.bool()
        dt = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
        lr = torch.where(m, logprobs.detach().to(dt) - behavior_logprobs.detach().to(dt), 0.0)
        ratio = lr.clamp(-log_ratio_clip, log_ratio_clip).exp()
        return cls.from_ratio(ratio, m)

    @classmethod
    def from_ratio(cls, ratio: torch.Tensor, mask: torch.Tensor) -> "RatioStats":
        """Statistics of given ratios ``[B, T]`` at the valid positions of ``mask``."""
        r = torch.where(mask, ratio.detach().double(), 0.0)
        return cls(r.sum().cpu(), (r * r).sum().cpu(), mask.sum().double().cpu())

    def __add__(self, other: "RatioStats") -> "RatioStats":
        return RatioStats(self.sum_ratio + other.sum_ratio, self.sum_sq + other.sum_sq, self.count + other.count)

    def to_tensor(self) -> torch.Tensor:
        return torch.stack([self.sum_ratio, self.sum_sq, self.count])

    def all_reduce(self, group=None) -> "RatioStats":
        """Sum the statistics over every rank of ``group`` (torch.distributed); a no-op if not initialised.

        One float64 all-reduce of three numbers. Returns a new RatioStats.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return self
        t = self.to_tensor()
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t = t.cpu()
        return RatioStats(t[0], t[1], t[2])

    def ess(self) -> tuple[float, bool]:
        """Return ``(ess, fell_back)``.

        ess = S1² / (n·S2) in [1/n, 1]. Falls back to 1.0 (the reference code's choice: full trust,
        no KL) when n = 0 or a sum is not finite; ``fell_back`` says so, and callers count it.
        """
        s1, s2, n = float(self.sum_ratio), float(self.sum_sq), float(self.count)
        if n < 0.5 or not (torch.isfinite(self.sum_ratio) and torch.isfinite(self.sum_sq)) or s2 <= 0.0:
            return 1.0, True
        e = s1 * s1 / (n * s2)
        if e != e:  # NaN
            return 1.0, True
        return min(e, 1.0), False
