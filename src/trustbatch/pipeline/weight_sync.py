"""Weight sync from the learner to the behaviour policy: the learner pushes, the engine loads named tensors.

Three implementations, chosen once by the recipe (never by the loop):

- ``SharedSync``: the engine samples from the learner's own module; a push only moves its version.
- ``CopySync``: the engine holds its own copy (another precision, int8, another process, or a learner
  sharded by FSDP2); a push sends the full named state, which the engine casts or re-quantizes.
- ``LaggedSync(k)``: the engine gets the weights of k optimizer steps ago (the lab's exact staleness);
  it records a snapshot after every optimizer step (``record``, registered with the learner).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol

import torch

from ..parallel import full_tensor
from ..policy.lora import has_lora, merged_state_dict


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The full state of ``model`` as detached ``(name, tensor)`` pairs, tied weights included.

    A model with LoRA adapters gives its merged state, ``W + (α/r)·B·A`` under the base model's names
    (``policy.lora.merged_state_dict``): engines always receive the policy being trained, never adapters.
    Of an FSDP2 (sharded) model, whole tensors: each is all-gathered, so every rank must iterate it to the
    end together (the weight syncs run on every rank after the same optimizer steps).
    """
    if has_lora(model):
        yield from merged_state_dict(model).items()
        return
    for name, t in model.state_dict().items():
        yield name, full_tensor(t.detach())


class WeightSync(Protocol):
    def push(self, model: torch.nn.Module, version: int) -> None:
        """Make the behaviour policy follow ``model``, now at policy ``version``."""
        ...

    def state_dict(self) -> dict:
        """What a resume needs to serve the same weights again; empty when the learner's own weights suffice
        (then no checkpoint stores it)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s state; the next ``push`` serves from it."""
        ...


class Stateless:
    """A weight sync whose behaviour policy is the learner's current weights: nothing to checkpoint."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SharedSync(Stateless):
    """The engine shares the learner's module: nothing to copy, the version moves."""

    def __init__(self, engine):
        self.engine = engine

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.engine.load_weights((), version)


class CopySync(Stateless):
    """The engine holds its own copy: send the full named state after every round."""

    def __init__(self, engine):
        self.engine = engine

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.engine.load_weights(named_weights(model), version)


class WeightHistory:
    """Snapshots of the policy's weights by version (optimizer step), to serve the policy of k steps ago."""

    def __init__(self, keep: int):
        self.keep = keep
        self._states: OrderedDict[int, dict] = OrderedDict()

    def record(self, version: int, model: torch.nn.Module) -> None:
        self._states[version] = {k: v.clone() for k, v in named_weights(model)}
        while len(self._states) > self.keep + 1:
            self._states.popitem(last=False)

    def at_or_before(self, version: int) -> tuple[int, dict]:
        """The newest snapshot with version ≤ ``version`` (the oldest kept if none): (its version, state)."""
        best = max((v for v in self._states if v <= version), default=min(self._states))
        return best, self._states[best]


class LaggedSync:
    """The engine samples from the policy as it was ``lag`` optimizer steps ago (exact, by snapshot).

    ``record(version, model)`` must run after every optimizer step (the recipe registers it with the
    learner), so that a lag that is not a multiple of the steps per round is still served exactly.
    ``keep`` bounds the snapshots held (lag + optimizer steps per round is enough).
    """

    def __init__(self, engine, lag: int, keep: int):
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.engine = engine
        self.lag = lag
        self.history = WeightHistory(keep)

    def record(self, version: int, model: torch.nn.Module) -> None:
        self.history.record(version, model)

    def push(self, model: torch.nn.Module, version: int) -> None:
        if version not in self.history._states:
            self.record(version, model)
        served, state = self.history.at_or_before(version - self.lag)
        self.engine.load_weights(state.items(), served)

    def state_dict(self) -> dict:
        """The snapshots (lag + steps per round state dicts): a resume serves exactly the same old weights."""
        return {"snapshots": dict(self.history._states)}

    def load_state_dict(self, state: dict) -> None:
        self.history._states.clear()
        self.history._states.update(sorted(state["snapshots"].items()))
