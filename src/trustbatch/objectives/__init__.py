"""Policy objectives as pure functions on tensors (torch only), in a name → ``ObjectiveSpec`` registry.

    from trustbatch import objectives
    out = objectives.get("p3o")(logprobs, behavior_logprobs, advantages, mask)
    out.loss.backward(); print(out.metrics["ess"])

Every objective: ``f(logprobs [B,T], behavior_logprobs [B,T], advantages [B,T] or [B], mask [B,T],
**options) -> ObjectiveOutput(loss: scalar tensor, metrics: dict[str, float])``. The loss is the
masked token mean unless ``aggregation=`` says otherwise. Formulas and sources:
docs/design/objectives.md and each function's docstring.

Each objective declares at registration what the caller must supply (``spec(name)``: needs_proximal,
batch_stats, ess_scopes), how its user options are checked (``validate_options``) and how each of its
metrics reduces over micro-batches and ranks (``spec(name).metrics``, ``objectives.metrics``). Importing
this package imports torch and nothing else heavy (torch.distributed only when all-reducing).
"""

from __future__ import annotations

from ._common import (AGGREGATIONS, DEFAULT_LOG_RATIO_CLIP, ESS_SCOPES, ObjectiveOutput, aggregate,
                      deferred_grad_refusals, quantiles, with_budget_constant)
from .clipped import cispo, dapo, decoupled_ppo, grpo, gspo, ppo_clip_per_token, reinforce  # registers them
from .corrections import CORRECTIONS, correction_weights
from .kl import FULL_KL_ESTIMATORS, KL_ESTIMATORS, exact_kl, kl_estimate, top_k_kl_lower_bound
from .metrics import MAX, SUM, TOKEN_MEAN, MetricReducer, RatioOf
from .p3o import CAP_RTOL, p3o, p3o_two_anchor  # registers them
from .ratio_stats import RatioStats
from .registry import (LEARNER_SUPPLIED, TENSOR_INPUTS, TRAINER_SUPPLIED, Objective, ObjectiveSpec, Opt, get, names,
                       register, spec, validate_options)

__all__ = [
    "AGGREGATIONS", "CAP_RTOL", "CORRECTIONS", "DEFAULT_LOG_RATIO_CLIP", "ESS_SCOPES", "FULL_KL_ESTIMATORS", "KL_ESTIMATORS", "MAX",
    "LEARNER_SUPPLIED", "SUM", "TENSOR_INPUTS", "TOKEN_MEAN", "TRAINER_SUPPLIED", "MetricReducer", "Objective", "ObjectiveOutput",
    "ObjectiveSpec", "Opt", "RatioOf", "RatioStats", "aggregate", "cispo", "correction_weights", "dapo", "decoupled_ppo", "deferred_grad_refusals", "exact_kl", "get", "grpo", "gspo", "kl_estimate",
    "names", "p3o", "p3o_two_anchor", "ppo_clip_per_token", "quantiles", "register", "reinforce", "spec", "top_k_kl_lower_bound",
    "validate_options", "with_budget_constant",
]
