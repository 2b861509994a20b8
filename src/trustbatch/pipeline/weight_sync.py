"""Weight sync from the learner to the behaviour policy: the learner pushes, the engine loads named tensors.

Three implementations, chosen once by the recipe (never by the loop):

- ``SharedSync``: the engine samples from the learner's own module; a push only moves its version.
- ``CopySync``: the engine holds its own copy (another precision, int8, another process, or a learner
  sharded by FSDP2); a push sends the full named state, which the engine casts or re-quantizes.
- ``LaggedSync(k)``: the engine gets the weights of k optimizer steps ago (the lab's exact staleness);
  it records a snapshot after every optimizer step (``record``, registered with the learner).

``BehaviourVersions`` wraps an async run's transport for the exact KL: it keeps the pushed weights a batch in flight
may have been sampled with, and hands the learner each batch's behaviour model rebuilt from them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol

import torch

from ..parallel import full_tensor
from ..policy.forward import Teacher
from ..policy.lora import has_lora, merged_copy, merged_weights
from .batch import TrainBatch


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The full state of ``model`` as detached ``(name, tensor)`` pairs, tied weights included.

    A model with LoRA adapters gives its merged state, ``W + (α/r)·B·A`` under the base model's names
    (``policy.lora.merged_weights``): engines always receive the policy being trained, never adapters.
    Of an FSDP2 (sharded) model, whole tensors: each is all-gathered, so every rank must iterate it to the
    end together (the weight syncs run on every rank after the same optimizer steps).
    """
    if has_lora(model):
        yield from merged_weights(model)
        return
    for name, t in model.state_dict().items():
        yield name, full_tensor(t.detach())


def host_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_weights`` of ``model`` on the CPU, for a transport to another process (a rollout worker process or a
    Ray actor), whose engine is built on the CPU from a saved copy of the policy: a CUDA tensor would make every
    worker open a CUDA context on the learner's GPU (or fail to unpickle where it has none). A CPU tensor is yielded
    as it is (no copy); the transport copies it into its own memory.

    Untested on CUDA here: ``tests/gpu/test_train_cuda.py`` runs an async round with a CUDA learner.
    """
    for name, t in named_weights(model):
        yield name, t.cpu()


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


class BehaviourVersions:
    """The behaviour model of each batch that rollout workers sample, rebuilt in the learner's process (exact KL).

    A worker samples in another process (or machine), so its batch cannot carry its engine's module as
    ``TrainBatch.behaviour``; but every version a worker samples with is one the learner pushed or started from, and
    each row records its version. As the run's weight sync around ``inner`` (the transport), this keeps a host copy of
    every pushed state while a batch sampled with it may still be trained on (versions ≥ the newest − ``max_lag``),
    and one frozen copy of the policy, which ``attach`` loads with a batch's version and names that batch's
    ``Teacher``: the learner teacher-forces it per chunk, as a sync run's engine module. Memory: one copy of the
    policy on the learner's device, and at most ⌊max_lag / m⌋ + 1 state dicts on the host (m optimizer steps a
    round; a version is pushed once a round).

    Args:
        inner: the transport's weight sync; every ``push`` goes on to it.
        model: the learner's policy now, at ``version``: the workers' first weights (LoRA: merged, as pushed).
        version: its policy version.
        max_lag: the most versions a trained-on batch can lag the learner (the source's bound k; the controller's
            k_max for ``max_staleness=auto``).
        temperature: the workers' sampling temperature (1 when they decode greedily).
        autocast: the dtype the workers' engines sample under (the learner's, bf16-mixed), or None.
    """

    def __init__(self, inner: WeightSync, model: torch.nn.Module, *, version: int, max_lag: int, temperature: float,
                 autocast: torch.dtype | None = None):
        self.inner, self.max_lag, self.temperature, self.autocast = inner, max_lag, temperature, autocast
        self.frozen = merged_copy(model).requires_grad_(False)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self._loaded: int | None = None
        self.record(version, model)

    def record(self, version: int, model: torch.nn.Module) -> None:
        """Keep ``model``'s weights (``named_weights``) as policy ``version``."""
        if version not in self.states:
            self.keep(version, dict(named_weights(model)))

    def keep(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Keep ``state`` (named tensors) as policy ``version``, on the host; drop versions older than the newest
        − ``max_lag``, which no batch the learner trains on can carry (``staleness.too_stale``)."""
        self.states[version] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        newest = max(self.states)
        for v in [v for v in self.states if v < newest - self.max_lag]:
            del self.states[v]

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.record(version, model)
        self.inner.push(model, version)

    def state_dict(self) -> dict:
        """The transport's: a resume gets the kept versions back from the source's snapshots and its own policy."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def attach(self, batch: TrainBatch) -> None:
        """Set ``batch.behaviour`` to ``{v: Teacher(frozen copy at version v)}`` for the version v of its rows. The
        copy holds v until the next ``attach``: the learner trains on one batch at a time.

        Raises:
            ValueError: rows of several versions (a worker samples a batch with one), or a version not kept.
        """
        versions = batch.policy_version.unique().tolist()
        if len(versions) != 1:
            raise ValueError(f"a rollout worker's batch has rows of policy versions {versions}; it samples with one")
        v = int(versions[0])
        if v not in self.states:
            raise ValueError(f"the weights of policy version {v}, which sampled this batch, are not kept (kept: "
                             f"{sorted(self.states)}); the exact KL cannot rebuild its behaviour distribution")
        if self._loaded != v:
            self.frozen.load_state_dict(self.states[v])
            self._loaded = v
        batch.behaviour = {v: Teacher(self.frozen, self.temperature, self.autocast,
                                      name=f"the behaviour policy (version {v})")}
