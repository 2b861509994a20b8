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
    """

    packed: Packed
    behavior_logprobs: torch.Tensor  # [B, C] float32, log π_b at sampling
    advantages: torch.Tensor  # [B] float32
    policy_version: torch.Tensor | None = None  # [B] long; None: all rows from version 0
    proximal_logprobs: torch.Tensor | None = None  # [B, C], for objectives that declare needs_proximal
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.policy_version is None:
            self.policy_version = torch.zeros(self.advantages.shape[0], dtype=torch.long)

    def __len__(self) -> int:
        return self.advantages.shape[0]

    def select(self, idx) -> "TrainBatch":
        """Rows ``idx`` (a slice, index tensor or list); ``metrics`` are not carried over."""
        prox = None if self.proximal_logprobs is None else self.proximal_logprobs[idx]
        return TrainBatch(self.packed.select(idx), self.behavior_logprobs[idx], self.advantages[idx],
                          self.policy_version[idx], prox)

    def behaviour_versions(self) -> torch.Tensor:
        """Versions of the rows sampled by the policy itself (foreign rows left out), long [≤ B]."""
        return self.policy_version[self.policy_version >= 0]


def build_batch(rollouts, advantages: torch.Tensor, pad_id: int, metrics: dict | None = None) -> TrainBatch:
    """Pack ``Rollout`` records into learner tensors; behaviour log-probs are right-aligned like the completions.

    advantages: [B], one per rollout. Raises ValueError on an empty completion (see ``pack``).
    """
    packed = pack([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    C = packed.response_mask.shape[1]
    blp = torch.zeros(len(rollouts), C, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        blp[i, C - len(r.behavior_logprobs):] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    versions = torch.tensor([r.policy_version for r in rollouts], dtype=torch.long)
    return TrainBatch(packed=packed, behavior_logprobs=blp, advantages=advantages.float(), policy_version=versions,
                      metrics=dict(metrics or {}))
