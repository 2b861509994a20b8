"""Policy objectives as pure functions on tensors (torch only), in a name → function registry.

    from trustbatch import objectives
    out = objectives.get("p3o")(logprobs, behavior_logprobs, advantages, mask)
    out.loss.backward(); print(out.metrics["ess"])

Every objective: ``f(logprobs [B,T], behavior_logprobs [B,T], advantages [B,T] or [B], mask [B,T],
**options) -> ObjectiveOutput(loss: scalar tensor, metrics: dict[str, float])``. The loss is the
masked token mean unless ``aggregation=`` says otherwise. Formulas and sources:
shared/docs/objectives.md and each function's docstring.
"""

from __future__ import annotations

from typing import Callable

from ._common import AGGREGATIONS, ObjectiveOutput, aggregate
from .clipped import cispo, dapo, decoupled_ppo, grpo, gspo, ppo_clip_per_token, reinforce
from .corrections import CORRECTIONS, correction_weights
from .kl import KL_ESTIMATORS, kl_estimate
from .p3o import ESS_SCOPES, p3o, p3o_two_anchor
from .ratio_stats import RatioStats

Objective = Callable[..., ObjectiveOutput]

_REGISTRY: dict[str, Objective] = {}

# Objectives whose loss depends on the batch ESS: the trainer computes it over the whole
# optimizer batch and passes ``ess=`` when it splits the batch into micro-batches.
USES_BATCH_ESS = {"p3o", "p3o_two_anchor"}
# Objectives that need log-probs of a proximal policy (a snapshot at the start of the epoch).
NEEDS_PROXIMAL = {"p3o_two_anchor", "decoupled_ppo"}


def register(name: str, fn: Objective | None = None):
    """Register ``fn`` under ``name`` (usable as a decorator). Raises ValueError on a taken name."""

    def _add(f: Objective) -> Objective:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} is already registered")
        _REGISTRY[name] = f
        return f

    return _add(fn) if fn is not None else _add


def get(name: str) -> Objective:
    """The objective registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; choose one of {names()}") from None


def names() -> list[str]:
    """Registered objective names, sorted."""
    return sorted(_REGISTRY)


for _name, _fn in {
    "p3o": p3o,
    "p3o_two_anchor": p3o_two_anchor,
    "grpo": grpo,
    "dapo": dapo,
    "gspo": gspo,
    "cispo": cispo,
    "decoupled_ppo": decoupled_ppo,
    "reinforce": reinforce,
}.items():
    register(_name, _fn)

__all__ = [
    "AGGREGATIONS", "CORRECTIONS", "ESS_SCOPES", "KL_ESTIMATORS", "NEEDS_PROXIMAL", "USES_BATCH_ESS",
    "ObjectiveOutput", "RatioStats", "aggregate", "correction_weights", "get", "kl_estimate", "names",
    "ppo_clip_per_token", "register",
]
