"""The engine protocol: the behaviour policy that samples completions and records their log-probs.

An engine may live in another process (a rollout worker, a vLLM server), so nothing but token ids,
floats and named tensors crosses this boundary: ``generate`` takes token ids and returns
``Rollout`` records, ``load_weights`` takes ``(name, tensor)`` pairs. The learner owns the policy
version; an engine only copies the version it was given into every sample it produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

# The version of an engine that does not sample a version of the policy at all (the lab's foreign
# model): its samples never count towards staleness.
NOT_THE_POLICY = -1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature and nucleus (top-p) filtering, or greedy decoding.

    temperature: > 0, divides the logits. top_p: in (0, 1]. max_new_tokens: ≥ 1, EOS included.
    greedy: argmax decoding (temperature and top_p are ignored; behaviour log-probs are then those
    of the untempered distribution).

    Raises:
        ValueError: a value out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False

    def __post_init__(self):
        # transformers' warpers take a Python float alone (an int 2 or a numpy float32 was "not strictly positive")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}; "
                             "use greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def end_ids_of(eos_id: int | Iterable[int]) -> tuple[int, ...]:
    """The tokens that end a completion, as a tuple: one EOS id, or several (``Policy.end_ids``)."""
    return (int(eos_id),) if isinstance(eos_id, int) else tuple(int(i) for i in eos_id)


@dataclass
class Rollout:
    """One sampled completion.

    completion_ids ends with EOS unless ``truncated``; ``behavior_logprobs`` has one float32 entry
    per completion token: the log-prob under the distribution it was actually sampled from
    (temperature and top-p applied). ``policy_version`` is the learner's optimizer-step count of the
    weights that sampled it (``NOT_THE_POLICY`` for a foreign model). An engine that declares ``full``
    (``rollout.spec``) records no whole distribution and hands the learner its ``teacher`` instead; one that
    declares ``recorded``, asked to record, fills ``behavior_logprobs_full`` ([len(completion_ids), V] float32:
    the log-softmax of the processed scores of each step, whose values at the sampled tokens are
    ``behavior_logprobs``); one that declares ``top_k``, asked to record, fills ``behavior_top_logprobs``
    ([len(completion_ids), k] float32: the k largest processed log-probs of each step, largest first) and
    ``behavior_top_ids`` ([len(completion_ids), k] long: their tokens). None otherwise.
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]
    truncated: bool
    policy_version: int
    behavior_logprobs_full: torch.Tensor | None = None
    behavior_top_logprobs: torch.Tensor | None = None
    behavior_top_ids: torch.Tensor | None = None


class Engine(Protocol):
    """A behaviour policy. Implementations: ``TransformersEngine``; the vLLM engine (issue 11)."""

    version: int  # set by the constructor and by load_weights only; copied into every Rollout

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 seeds: list[int] | None = None) -> list[Rollout]:
        """Sample ``n`` completions for each prompt (token ids); grouped: prompt 0's n first.

        ``seeds``, one per prompt, fix each group's random streams where the engine can (the same
        group then comes out the same from any process or batch); None: the engine's own randomness.
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the learner's float weights as policy ``version``.

        ``weights`` is the full named state (tied weights included). An engine that shares the
        learner's module (same process) accepts an empty iterable: the weights are already in
        place and only the version moves.
        """
        ...
