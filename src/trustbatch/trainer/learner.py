"""The learner: one optimizer step over a batch of rollouts, in micro-batches, with a global token mean.

For P3O with ``ess_scope="batch"`` the ESS must cover the whole optimizer batch (every micro-batch,
every data-parallel rank) at the current parameters. When the batch is split, a no-grad pass first
accumulates ``RatioStats`` (Σρ, Σρ², n in float64), all-reduces them, and the resulting ESS is
passed to the loss of every micro-batch. When the batch is one micro-batch on one rank, the
loss computes the same ESS from its own inputs and the extra pass is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import objectives
from ..objectives import RatioStats
from ..policy.forward import Packed, response_logprobs


@dataclass
class TrainBatch:
    """Tensors of one optimizer step. Response tensors are ``[B, C]``."""

    packed: Packed
    behavior_logprobs: torch.Tensor  # [B, C] float32, log π_b at sampling
    advantages: torch.Tensor  # [B] float32
    proximal_logprobs: torch.Tensor | None = None  # [B, C], for objectives that need π_prox

    def __len__(self) -> int:
        return self.advantages.shape[0]

    def select(self, idx) -> "TrainBatch":
        prox = None if self.proximal_logprobs is None else self.proximal_logprobs[idx]
        return TrainBatch(self.packed.select(idx), self.behavior_logprobs[idx], self.advantages[idx], prox)


# Metrics each micro-batch reports already normalised by the global token count (or as counts):
# they add up over micro-batches instead of being token-weighted.
_ADDITIVE = ("loss", "policy_loss", "kl_loss", "ess_fallback", "num_tokens")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(x: float) -> float:
    if not _distributed():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0])


class Learner:
    """Owns the policy's optimizer and applies the configured objective.

    Args:
        model: the policy module (trained in place).
        objective: a registered objective name (``trustbatch.objectives.names()``).
        options: keyword options for the objective (e.g. eps_low, kl).
        ess_scope: "batch", "micro_batch" or "sequence" (P3O family only).
    """

    def __init__(self, model: torch.nn.Module, objective: str, options: dict | None = None, *, lr: float = 1e-3,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, micro_batch_size: int = 256,
                 ess_scope: str = "batch", warmup_steps: int = 0):
        self.model = model
        self.name = objective
        self.fn = objectives.get(objective)
        self.options = dict(options or {})
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.ess_scope = ess_scope
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        # Linear warm-up: Adam's first bias-corrected steps are close to lr·sign(g) on every weight,
        # a large random kick to a warmed-up policy when the policy gradient is noisy.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        )

    def _chunks(self, n: int) -> list[slice]:
        return [slice(s, min(n, s + self.micro_batch_size)) for s in range(0, n, self.micro_batch_size)]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, C]`` of the batch's completions under the current policy (no gradient)."""
        return torch.cat([response_logprobs(self.model, batch.packed.select(c))[0] for c in self._chunks(len(batch))])

    @torch.no_grad()
    def batch_ratio_stats(self, batch: TrainBatch) -> RatioStats:
        """Σρ, Σρ², n over the whole batch at the current θ, summed over data-parallel ranks."""
        stats = RatioStats.zeros()
        for c in self._chunks(len(batch)):
            mb = batch.select(c)
            logp, _ = response_logprobs(self.model, mb.packed)
            stats = stats + RatioStats.from_logprobs(logp, mb.behavior_logprobs, mb.packed.response_mask)
        return stats.all_reduce()

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``. Returns metrics (token-weighted means over micro-batches)."""
        self.model.train()
        mask = batch.packed.response_mask
        n_tokens = _all_reduce_sum(float(mask.sum()))
        n_seqs = _all_reduce_sum(float((mask.sum(1) > 0).sum()))
        chunks = self._chunks(len(batch))
        extra: dict = {}
        if self.name in objectives.USES_BATCH_ESS:
            if self.ess_scope == "batch" and (len(chunks) > 1 or _distributed()):
                extra["ess"] = self.batch_ratio_stats(batch)
            elif self.name == "p3o":
                extra["ess_scope"] = self.ess_scope
        if self.name in objectives.NEEDS_PROXIMAL:
            if batch.proximal_logprobs is None:
                raise ValueError(f"objective {self.name!r} needs proximal log-probs; the loop must set them")

        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        for c in chunks:
            mb = batch.select(c)
            m = mb.packed.response_mask
            logp, ent = response_logprobs(self.model, mb.packed, with_entropy=True)
            kw = dict(extra)
            if mb.proximal_logprobs is not None and self.name in objectives.NEEDS_PROXIMAL:
                kw["proximal_logprobs"] = mb.proximal_logprobs
            if self.ess_scope == "micro_batch" and self.name in objectives.USES_BATCH_ESS and _distributed():
                kw["ess"] = RatioStats.from_logprobs(logp, mb.behavior_logprobs, m).all_reduce()
            out = self.fn(logp, mb.behavior_logprobs, mb.advantages, m, num_tokens=n_tokens,
                          num_sequences=n_seqs, **kw, **self.options)
            out.loss.backward()
            w = float(m.sum())
            metrics = dict(out.metrics)
            metrics["entropy"] = float((ent * m).sum() / max(w, 1.0))
            for k, v in metrics.items():
                if k.endswith("_max"):
                    maxes[k] = max(maxes.get(k, float("-inf")), v)
                elif k in _ADDITIVE:
                    sums[k] = sums.get(k, 0.0) + v
                else:
                    sums[k] = sums.get(k, 0.0) + v * w
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        local = float(mask.sum())
        out_m = {k: (v if k in _ADDITIVE else v / max(local, 1.0))
                 for k, v in sums.items()}
        out_m.update(maxes)
        out_m["grad_norm"] = float(grad_norm)
        out_m["lr"] = self.scheduler.get_last_lr()[0]
        return out_m
