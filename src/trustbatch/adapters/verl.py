"""trustbatch objectives in verl's policy-loss registry (verl 0.9; ``pip install trustbatch[verl]``).

    from trustbatch.adapters.verl import register_with_verl
    register_with_verl(options={"p3o": {"kl": "k3"}})     # -> ["trustbatch_p3o", "trustbatch_grpo", ...]
    # then: actor_rollout_ref.actor.policy_loss.loss_mode=trustbatch_p3o

What verl hands the loss, and what that means for P3O:

- **Behaviour policy.** verl's policy loss receives ``old_log_prob``. In verl's default (decoupled)
  mode that is π_old, recomputed by the trainer at the rollout's parameters, not the policy that
  sampled; only in **bypass mode** (``algorithm.rollout_correction.bypass_mode=true``) is
  ``old_log_prob`` the rollout engine's own log-probs, i.e. P3O's behaviour policy π_b. The actor's
  config does not carry the algorithm's setting, so the loss reads its mirror
  ``actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode`` and refuses to run (one
  line) unless it is true, and refuses verl's rollout importance weights (``rollout_is_weights``),
  which only decoupled mode computes: P3O corrects for π_b itself.
- **Normaliser.** verl's global-batch normalisation (``config.global_batch_info``: ``dp_size``,
  ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) is followed exactly as
  ``core_algos.agg_loss`` does it for each ``actor.loss_agg_mode``, so the micro-batches and ranks
  of a mini-batch add up to the loss of the whole mini-batch.
- **ESS scope: micro-batch × rank.** No process group reaches verl's policy loss, so each
  micro-batch on each rank computes its own ESS (the reference code's choice), not the mini-batch's.
- **Options.** An objective's options are fixed at registration (checked by
  ``objectives.validate_options``); verl's ``clip_ratio*`` keys are not read. ``aggregation`` is
  verl's ``loss_agg_mode``. verl's entropy bonus and reference KL stay verl's (added outside the
  policy loss).

Every process that builds a verl actor must register: verl imports the modules named in
``VERL_USE_EXTERNAL_MODULES`` whenever verl is imported, so
``VERL_USE_EXTERNAL_MODULES=trustbatch.adapters.verl_plugin`` registers the defaults everywhere
(or name your own module that calls ``register_with_verl(options=...)``). Ray workers inherit the
variable through verl's runtime environment only if you pass it there; untested on a real cluster.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .. import objectives
from ..errors import UserError
from ._common import METRIC_PREFIX, check_objective, ess_kwargs, import_stack, usable_objectives

DEFAULT_PREFIX = "trustbatch_"
BYPASS_KEY = "actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode"
# verl's loss_agg_mode -> trustbatch aggregation; verl's mode names are core_algos.agg_loss's
_AGGREGATION = {
    "token-mean": "token_mean",
    "token-sum": "token_mean",  # rescaled by the local count below
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "seq_mean_token_sum",
}


# options verl's own config sets: given as objective options too, they would clash with (or silently override) it
VERL_FIXED = {"aggregation": "set actor_rollout_ref.actor.loss_agg_mode",
              "seq_constant": "set actor_rollout_ref.actor.loss_scale_factor",
              "ref_kl": "its reference KL is verl's own: set actor_rollout_ref.actor.kl_loss_type"}


def _core_algos():
    return import_stack("verl.trainer.ppo.core_algos", "verl")


def register_with_verl(names: Iterable[str] | None = None, *, options: dict[str, dict] | None = None,
                       prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Register trustbatch objectives in verl's policy-loss registry as ``prefix + name``.

    Args:
        names: trustbatch objectives to register; default every one that needs no proximal snapshot
            (``p3o``, ``grpo``, ``cispo``, ``dapo``, ``gspo``, ``reinforce``).
        options: objective name -> its user options (``objectives.validate_options``), fixed for
            the process; ``aggregation`` is refused (verl's ``actor.loss_agg_mode`` decides).
        prefix: what the registered names start with; verl's own names are plain (``vanilla``,
            ``cispo``, ...), so the default cannot shadow them.

    Returns:
        The registered verl names, in the order of ``names``.

    Raises:
        UserError: verl is not installed; an unknown or unusable objective; options for an
            objective not in ``names``; a bad option; a name already in verl's registry (verl's
            ``register_policy_loss`` overwrites without a word, so a second registration, or one
            that would replace verl's own loss, is refused before anything is registered).
    """
    core_algos = _core_algos()
    names = list(usable_objectives() if names is None else names)
    options = dict(options or {})
    stray = sorted(set(options) - set(names))
    if stray:
        raise UserError(f"register_with_verl: options given for {stray}, which are not registered; "
                        f"add them to names= or drop their options")
    checked = {n: check_objective(n, options.get(n), stack="verl", fixed=VERL_FIXED) for n in names}
    registry = core_algos.POLICY_LOSS_REGISTRY
    taken = [prefix + n for n in names if prefix + n in registry]
    if taken:
        raise UserError(f"verl's policy-loss registry already holds {taken}, and verl would overwrite them silently; "
                        f"register once per process, or pass another prefix=")
    for n in names:
        core_algos.register_policy_loss(prefix + n)(make_policy_loss(n, checked[n]))
    return [prefix + n for n in names]


def make_policy_loss(name: str, options: dict | None = None) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """A verl policy-loss function (``core_algos.PolicyLossFn``) computing trustbatch objective ``name``.

    The returned function has verl's signature ``(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode="token-mean", config=None, rollout_is_weights=None) -> (loss, metrics)``:
    old_log_prob, log_prob, advantages, response_mask are [B, T] (log-probs in nats, log_prob with
    gradient); ``config`` is verl's ``ActorConfig``. The loss is ``objectives.get(name)`` with
    behaviour log-probs = ``old_log_prob`` and verl's normaliser:

        token-mean:              Σ ℓ_t / batch_num_tokens · dp_size
        token-sum:               Σ ℓ_t · dp_size
        seq-mean-token-mean:     Σ_seq (Σ_t ℓ_t / |seq|) / global_batch_size · dp_size
        seq-mean-token-sum(-norm): Σ_seq Σ_t ℓ_t / global_batch_size · dp_size (/ loss_scale_factor or T)

    (verl ``core_algos.agg_loss``; with ``batch_num_tokens``/``global_batch_size`` unset, the
    micro-batch's own counts, as there). Metrics: trustbatch's, as floats, under
    ``actor/trustbatch/<key>`` (``ess``, ``cap_fraction``, ``kl_weight``, ...).

    Raises (at call time):
        UserError: no config; bypass mode not declared on the actor (``BYPASS_KEY``); verl's rollout
            importance weights passed; an unknown ``loss_agg_mode``; dp_size > 1 without the global counts.
        ValueError: the objective's own errors (shapes, non-finite values).
    """
    fn = objectives.get(name)
    opts = check_objective(name, options, stack="verl", fixed=VERL_FIXED)
    scope = ess_kwargs(name, "micro_batch")

    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config=None,
                    rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise UserError(f"{name} (verl): the policy loss needs verl's actor config; call it as verl's actor does")
        _require_bypass(config, name)
        if rollout_is_weights is not None:
            raise UserError(f"{name} (verl): verl passed rollout importance weights, but the objective corrects for the "
                            f"rollout policy itself; set algorithm.rollout_correction.rollout_is=null")
        if loss_agg_mode not in _AGGREGATION:
            raise UserError(f"{name} (verl): loss_agg_mode {loss_agg_mode!r} is not one of {sorted(_AGGREGATION)}")
        info = dict(getattr(config, "global_batch_info", None) or {})
        dp = int(info.get("dp_size") or 1)
        kw = {"aggregation": _AGGREGATION[loss_agg_mode]}
        if loss_agg_mode == "token-mean":
            kw["num_tokens"] = _global_count(info, "batch_num_tokens", dp, name, loss_agg_mode)
        elif loss_agg_mode.startswith("seq-mean"):
            kw["num_sequences"] = _global_count(info, "global_batch_size", dp, name, loss_agg_mode)
            if loss_agg_mode == "seq-mean-token-sum":
                kw["seq_constant"] = 1.0
            elif info.get("loss_scale_factor") is not None:
                kw["seq_constant"] = float(info["loss_scale_factor"])
        out = fn(log_prob, old_log_prob, advantages, response_mask, **kw, **scope, **opts)
        loss = out.loss * dp
        if loss_agg_mode == "token-sum":
            # trustbatch has no sum aggregation: its local token mean times the local count is the sum
            loss = loss * response_mask.sum().to(loss.dtype)
        metrics = {f"actor/{METRIC_PREFIX}{k}": v for k, v in out.metrics.items() if k != "loss"}
        return loss, metrics

    policy_loss.__name__ = policy_loss.__qualname__ = f"trustbatch_{name}_policy_loss"
    policy_loss.__doc__ = f"trustbatch objective {name!r} as a verl policy loss; see make_policy_loss."
    return policy_loss


def _global_count(info: dict, key: str, dp: int, name: str, mode: str) -> float | None:
    v = info.get(key)
    if v is None:
        if dp > 1:
            raise UserError(f"{name} (verl): loss_agg_mode {mode!r} with dp_size {dp} needs global_batch_info[{key!r}], "
                            f"which verl's actor sets; call the loss through verl's ppo_loss")
        return None
    return float(v.item() if isinstance(v, torch.Tensor) else v)


def _require_bypass(config, name: str) -> None:
    """Refuse verl's decoupled mode, where old_log_prob is the trainer's π_old and not the rollout policy."""
    pl = _get(config, "policy_loss")
    rc = _get(pl, "rollout_correction") if pl is not None else None
    if not bool(_get(rc, "bypass_mode") if rc is not None else False):
        raise UserError(f"{name} (verl) needs verl's bypass mode, where old_log_prob is the rollout policy's: set "
                        f"algorithm.rollout_correction.bypass_mode=true and {BYPASS_KEY}=true")


def _get(obj, key: str):
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    getter = getattr(obj, "get", None)
    if callable(getter):
        try:
            return getter(key, None)
        except TypeError:
            pass
    return getattr(obj, key, None)
