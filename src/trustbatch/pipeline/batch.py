"""The training batch: what a rollout source hands the learner, tagged with the policy version of every row."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policy.forward import Packed, pack


@dataclass
class TrainBatch:
    """Tensors of one rollout round. Response tensors are ``[B, C]`` (completions right-aligned).

    ``policy_version`` [B] long is the version of the weights that sampled each row
    (``rollout.NOT_THE_POLICY`` for a foreign model); staleness is computed from it, never from an
    engine. ``metrics`` are the round's rollout statistics (reward, lengths, scorer failures).

    ``behavior_logprobs_full`` / ``proximal_logprobs_full`` [B, C, V] float32: the behaviour policy's
    and the proximal snapshot's whole log-distributions at the response positions (0 elsewhere),
    only for objectives whose options need them (``ObjectiveSpec.needs_full_logprobs``).
    """

    packed: Packed
    behavior_logprobs: torch.Tensor  # [B, C] float32, log π_b at sampling
    advantages: torch.Tensor  # [B] float32
    policy_version: torch.Tensor | None = None  # [B] long; None: all rows from version 0
    proximal_logprobs: torch.Tensor | None = None  # [B, C], for objectives that declare needs_proximal
    metrics: dict[str, float] = field(default_factory=dict)
    behavior_logprobs_full: torch.Tensor | None = None  # [B, C, V]
    proximal_logprobs_full: torch.Tensor | None = None  # [B, C, V]

    def __post_init__(self):
        if self.policy_version is None:
            self.policy_version = torch.zeros(self.advantages.shape[0], dtype=torch.long)

    def __len__(self) -> int:
        return self.advantages.shape[0]

    def select(self, idx) -> "TrainBatch":
        """Rows ``idx`` (a slice, index tensor or list); ``metrics`` are not carried over."""
        prox = None if self.proximal_logprobs is None else self.proximal_logprobs[idx]
        full = {k: getattr(self, k)[idx] for k in ("behavior_logprobs_full", "proximal_logprobs_full")
                if getattr(self, k) is not None}
        return TrainBatch(self.packed.select(idx), self.behavior_logprobs[idx], self.advantages[idx],
                          self.policy_version[idx], prox, **full)

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on ``device`` (the learner's); ``metrics`` are kept. No copy where it is already."""
        if self.advantages.device == torch.device(device):
            return self
        opt = {k: None if getattr(self, k) is None else getattr(self, k).to(device)
               for k in ("proximal_logprobs", "behavior_logprobs_full", "proximal_logprobs_full")}
        return TrainBatch(self.packed.to(device), self.behavior_logprobs.to(device), self.advantages.to(device),
                          self.policy_version.to(device), metrics=self.metrics, **opt)

    def behaviour_versions(self) -> torch.Tensor:
        """Versions of the rows sampled by the policy itself (foreign rows left out), long [≤ B]."""
        return self.policy_version[self.policy_version >= 0]


def build_batch(rollouts, advantages: torch.Tensor, pad_id: int, metrics: dict | None = None) -> TrainBatch:
    """Pack ``Rollout`` records into learner tensors; behaviour log-probs are right-aligned like the completions.

    advantages: [B], one per rollout. Rollouts that carry ``behavior_logprobs_full`` give the batch's
    [B, C, V] tensor, right-aligned too.

    Raises:
        ValueError: an empty completion (see ``pack``); full log-probs on some rollouts only, or with
            different vocabulary sizes (a foreign engine on another vocabulary).
    """
    packed = pack([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    C = packed.response_mask.shape[1]
    blp = torch.zeros(len(rollouts), C, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        blp[i, C - len(r.behavior_logprobs):] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    versions = torch.tensor([r.policy_version for r in rollouts], dtype=torch.long)
    return TrainBatch(packed=packed, behavior_logprobs=blp, advantages=advantages.float(), policy_version=versions,
                      metrics=dict(metrics or {}), behavior_logprobs_full=_full_logprobs(rollouts, C))


def _full_logprobs(rollouts, C: int) -> torch.Tensor | None:
    """The rollouts' [n_i, V] behaviour log-distributions right-aligned into [B, C, V]; None if none has one."""
    have = [r.behavior_logprobs_full is not None for r in rollouts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(rollouts)} rollouts carry no full behaviour log-probs; "
                         "every engine of the round must be built with full_logprobs=True")
    vocab = {r.behavior_logprobs_full.shape[-1] for r in rollouts}
    if len(vocab) > 1:
        raise ValueError(f"the rollouts' full log-probs have vocabulary sizes {sorted(vocab)}; "
                         "the behaviour models must share the policy's vocabulary")
    out = torch.zeros(len(rollouts), C, vocab.pop(), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        n = r.behavior_logprobs_full.shape[0]
        out[i, C - n:] = r.behavior_logprobs_full
    return out
