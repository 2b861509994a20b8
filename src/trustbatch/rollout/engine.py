"""The engine protocol. A vLLM engine or a Ray worker pool is one more implementation of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Rollout:
    """One sampled completion.

    completion_ids ends with EOS unless ``truncated``; ``behavior_logprobs`` has one float32 entry
    per completion token: log-prob under the distribution it was actually sampled from
    (temperature and top-p applied). ``policy_version`` is the optimizer step of the weights used.
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]
    truncated: bool
    policy_version: int


class RolloutEngine(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, greedy: bool = False) -> list[Rollout]:
        """Sample ``n`` completions for each prompt; results are grouped: prompt 0's n first."""
        ...

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Make the behaviour policy equal to ``model``, now at ``version``."""
        ...
