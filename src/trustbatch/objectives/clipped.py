"""Clipped and capped policy-gradient baselines: GRPO/PPO, DAPO, decoupled PPO, CISPO, GSPO, REINFORCE.

Each is ``f(logprobs, behavior_logprobs, advantages, mask, **options) -> ObjectiveOutput`` with the
shared contract of ``trustbatch.objectives``. The ratio is r = π_θ/π_old where π_old is
``old_logprobs`` when given (a trainer recompute, "decoupled") and ``behavior_logprobs`` otherwise
("bypass"; docs/design/objectives.md §1.8 item 6). A mismatch ``correction`` (tis/mis/rej, token/sequence;
``trustbatch.objectives.corrections``) weighs the per-token loss by a function of π_old/π_behaviour,
so it needs ``old_logprobs``.

Correction options (grpo, dapo, cispo, gspo, reinforce): ``old_logprobs`` [B, T];
``correction`` (one of ``CORRECTIONS``); ``correction_cap`` (TIS cap and sequence-rejection
threshold, default 2); ``correction_band`` ((low, high) for mis_token and rej_token, default
(0.5, 5)); ``correction_seq_reduce`` ("mean"/"sum" for the tis_sequence/mis_sequence aliases);
``correction_count_rejected`` (masking kinds only, default True). With
``correction_count_rejected=False`` rejected tokens leave the loss entirely (policy term,
regularisers and the denominator), as when verl's rejection edits the response mask. The
denominator is then this call's kept-token count, unless ``num_tokens`` is given: it is used as
is, so to keep micro-batch losses summing to the batch loss the caller must pass the global count
of *kept* tokens (which needs ``old_logprobs`` for the whole batch before the first backward).
"""

from __future__ import annotations

from typing import Callable

import torch

from ._common import (DEFAULT_LOG_RATIO_CLIP, ObjectiveOutput, Prepared, add_regularizers, aggregate, finish, prepare,
                      ratio_metrics)
from .corrections import REJECTING, correction_weights
from .metrics import CORRECTION_METRICS, TOKEN_MEAN
from .registry import CORRECTION_OPTIONS, FLAG, NONNEG, number, register

_CORRECTION_KEYS = ("old_logprobs", *CORRECTION_OPTIONS)
_PPO_OPTIONS = {"eps_low": NONNEG, "eps_high": NONNEG, "dual_clip": number(gt=1, none_ok=True)}


def _split_correction(options: dict) -> tuple[torch.Tensor | None, dict]:
    corr = {k: options.pop(k) for k in _CORRECTION_KEYS if k in options}
    return corr.pop("old_logprobs", None), corr


def _old_and_weight(prep: Prepared, old_logprobs, corr: dict, metrics: dict
                    ) -> tuple[Prepared, torch.Tensor, torch.Tensor | None]:
    """Return (prep, log π_old, correction weight or None).

    ``prep`` is restricted to the kept tokens when a masking correction has count_rejected=False.
    """
    kind = corr.get("correction")
    count_rejected = corr.get("correction_count_rejected", True)
    if kind is None and len(corr) > ("correction" in corr):
        raise ValueError(f"{sorted(k for k in corr if k != 'correction')[0]} has no effect without correction=")
    if old_logprobs is None:
        if kind is not None:
            raise ValueError(
                f"correction={kind!r} needs old_logprobs (the trainer's log-probs at the rollout's "
                "parameters); without them π_old = π_behaviour and the weight would be 1"
            )
        return prep, prep.behavior_logprobs, None
    old = prep.sanitize("old_logprobs", old_logprobs)
    if kind is None:
        return prep, old, None
    if not count_rejected and kind not in REJECTING:
        raise ValueError(f"correction_count_rejected=False needs a masking correction {REJECTING}; {kind!r} rejects no token")
    w, kept, cm = correction_weights(
        old,
        prep.behavior_logprobs,
        prep.mask,
        kind,
        cap=corr.get("correction_cap", 2.0),
        band=tuple(corr.get("correction_band", (0.5, 5.0))),
        seq_reduce=corr.get("correction_seq_reduce"),
        log_ratio_clip=prep.opts.log_ratio_clip,
    )
    metrics.update(cm)
    if not count_rejected:
        prep = prep.with_mask(kept)
        old = torch.where(kept, old, 0.0)
    return prep, old, w


def ppo_clip_per_token(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token −min(r·A, clip(r, 1−ε_l, 1+ε_h)·A), with optional dual clip c for A < 0.

    PPO (arXiv 1707.06347), asymmetric bounds from DAPO (arXiv 2503.14476), dual clip from
    arXiv 1912.09729: for A < 0 the objective is max(min(...), c·A). Returns (loss [B, T],
    zero-gradient mask [B, T]: tokens whose gradient the clip removes).
    """
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(surr1, surr2)
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}")
        neg = adv < 0
        cap = -dual_clip * adv
        loss = torch.where(neg, torch.minimum(loss, cap), loss)
        clipped = clipped | (neg & (ratio > dual_clip))
    return loss, clipped


ZEROED_EPS = (0.2, 0.4)  # GRPO's usual clip and the P3O paper's
# grpo_zeroed_shares' metrics, each a share of one call's valid tokens
GRPO_ZEROED_METRICS = {f"grpo_zeroed_{e}": TOKEN_MEAN for e in ZEROED_EPS}


def grpo_zeroed_shares(
    logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    eps: tuple[float, ...] = ZEROED_EPS,
) -> dict[str, float]:
    """Share of valid tokens whose gradient GRPO's symmetric clip at each ε would zero, for any objective.

    A diagnostic the learner logs at every optimizer step when asked (``train.diagnostics``, which the
    lab sets; reduced as ``GRPO_ZEROED_METRICS`` declares), so the lab can see how far a P3O run's data sits
    from where a clipped objective would have stopped learning: token t counts when A > 0 and
    ρ > 1 + ε, or A < 0 and ρ < 1 − ε, with ρ = π_θ/π_b (``ppo_clip_per_token``'s zero-gradient mask;
    arXiv 1707.06347 Eq. 7).

    Args:
        logprobs, behavior_logprobs: [B, T] log-probs of the sampled tokens under π_θ and π_b.
        advantages: [B] or [B, T].
        mask: [B, T], 1 on valid completion tokens.

    Returns:
        {"grpo_zeroed_<ε>": share in [0, 1]} (0 for a micro-batch without valid tokens).
    """
    with torch.no_grad():
        adv = advantages if advantages.dim() == 2 else advantages[:, None]
        ratio = (logprobs.detach() - behavior_logprobs).clamp(-DEFAULT_LOG_RATIO_CLIP, DEFAULT_LOG_RATIO_CLIP).exp()
        valid = mask.bool()
        n = max(float(valid.sum()), 1.0)
        return {f"grpo_zeroed_{e}": float((ppo_clip_per_token(ratio, adv, e, e, None)[1] & valid).sum()) / n for e in eps}


def _surrogate(name: str, logprobs, behavior_logprobs, advantages, mask, options: dict,
               per_token: Callable[[Prepared, torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor | None]], *,
               corrections: bool = True) -> ObjectiveOutput:
    """The skeleton every objective of this module shares; ``per_token`` is what differs.

    Inputs are prepared (``_common.prepare``), the shared ratio metrics taken against π_b, π_old and the
    mismatch correction's weight w resolved from ``options`` (``_old_and_weight``); then
    ``per_token(prep, log π_old, metrics)`` returns the surrogate's per-token loss [B, T] and the tokens
    whose gradient its clip removes (None: no clip; ``clip_fraction`` then stays the shared metric's).
    The loss is w·ℓ plus the regularisers, aggregated as ``options`` say. ``corrections=False``: an
    objective without the correction options (they stay unknown options, refused by ``prepare``).
    """
    old_logprobs, corr = _split_correction(options) if corrections else (None, {})
    prep = prepare(name, logprobs, behavior_logprobs, advantages, mask, options)
    metrics = ratio_metrics(prep, prep.clamped_log_ratio().detach().exp())
    prep, old, w = _old_and_weight(prep, old_logprobs, corr, metrics)
    loss_t, clipped = per_token(prep, old, metrics)
    if w is not None:
        loss_t = loss_t * w
    loss_t = add_regularizers(loss_t, prep, metrics)
    if clipped is not None:
        metrics["clip_fraction"] = (clipped & prep.mask).sum() / prep.count.clamp_min(1.0)
    return finish(aggregate(loss_t, prep), metrics, prep)


def _ppo_clip(eps_low: float, eps_high: float, dual_clip: float | None):
    """GRPO's per-token term on r = π_θ/π_old, for ``_surrogate``."""

    def per_token(prep: Prepared, old: torch.Tensor, metrics: dict):
        c = prep.opts.log_ratio_clip
        ratio = (prep.logprobs - old).clamp(-c, c).exp()
        return ppo_clip_per_token(ratio, prep.advantages, eps_low, eps_high, dual_clip)

    return per_token


@register("grpo", options={**_PPO_OPTIONS, **CORRECTION_OPTIONS}, metrics=CORRECTION_METRICS)
def grpo(
    logprobs, behavior_logprobs, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.2,
    dual_clip: float | None = None, **options,
) -> ObjectiveOutput:
    """GRPO / PPO clipped surrogate (arXiv 2402.03300 Eq. 3; arXiv 1707.06347; docs/design/objectives.md §3.1–3.2).

    Per token: ℓ = −min(r·A, clip(r, 1−eps_low, 1+eps_high)·A), r = exp(logprobs − old). The gradient
    is exactly 0 where the clipped branch wins: (A > 0, r > 1+eps_high) or (A < 0, r < 1−eps_low).
    ``dual_clip`` c > 1 bounds the loss of A < 0 tokens at −c·A (zero gradient once r > c).
    The default aggregation is the token mean (DAPO-style); pass aggregation="seq_mean_token_mean"
    for the original GRPO. The reference KL (β = 0.04 in the paper) is ``ref_kl_coef`` with k3.

    Extra options: ``old_logprobs`` [B, T] and ``correction`` (see the module docstring).
    Shapes, errors and common options as ``trustbatch.objectives.p3o``.
    """
    return _surrogate("grpo", logprobs, behavior_logprobs, advantages, mask, options,
                      _ppo_clip(eps_low, eps_high, dual_clip))


@register("dapo", options={**_PPO_OPTIONS, **CORRECTION_OPTIONS}, metrics=CORRECTION_METRICS)
def dapo(
    logprobs, behavior_logprobs, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
    dual_clip: float | None = None, aggregation: str = "token_mean", **options,
) -> ObjectiveOutput:
    """DAPO preset (arXiv 2503.14476; docs/design/objectives.md §3.3): clip-higher (0.2, 0.28) and a token-level mean.

    Dynamic sampling and overlong shaping live on the data side (``trustbatch.advantages``).
    """
    return _surrogate("dapo", logprobs, behavior_logprobs, advantages, mask, {**options, "aggregation": aggregation},
                      _ppo_clip(eps_low, eps_high, dual_clip))


@register("decoupled_ppo", needs_proximal=True,
          options={**_PPO_OPTIONS, "behavior_weight_cap": number(gt=0, none_ok=True)},
          metrics={"behavior_weight_capped": TOKEN_MEAN, "behavior_weight_mean": TOKEN_MEAN})
def decoupled_ppo(
    logprobs, behavior_logprobs, advantages, mask, *, proximal_logprobs: torch.Tensor,
    eps_low: float = 0.2, eps_high: float = 0.2, behavior_weight_cap: float | None = None,
    dual_clip: float | None = None, **options,
) -> ObjectiveOutput:
    """Decoupled PPO with a proximal policy (Hilton et al., arXiv 2110.00641; docs/design/objectives.md §3.7).

    ℓ_t = sg(w_t)·(−min(r^prox·A, clip(r^prox, 1−ε_l, 1+ε_h)·A)), r^prox = π_θ/π_prox,
    w_t = π_prox/π_behaviour, capped at ``behavior_weight_cap`` when set (FeynRL uses 5.0 in async).
    Reduces to PPO when π_prox = π_behaviour.

    Args:
        proximal_logprobs: [B, T] log π_prox (no gradient): the policy at the start of the epoch.
    """
    def per_token(prep: Prepared, old: torch.Tensor, metrics: dict):
        prox = prep.sanitize("proximal_logprobs", proximal_logprobs, required="decoupled_ppo")
        c = prep.opts.log_ratio_clip
        w = (prox - prep.behavior_logprobs).clamp(-c, c).exp()
        if behavior_weight_cap is not None:
            metrics["behavior_weight_capped"] = ((w > behavior_weight_cap) & prep.mask).sum() / prep.count.clamp_min(1.0)
            w = w.clamp(max=behavior_weight_cap)
        metrics["behavior_weight_mean"] = (w * prep.maskf).sum() / prep.count.clamp_min(1.0)
        loss_t, clipped = _ppo_clip(eps_low, eps_high, dual_clip)(prep, prox, metrics)
        return loss_t * w, clipped

    return _surrogate("decoupled_ppo", logprobs, behavior_logprobs, advantages, mask, options, per_token,
                      corrections=False)


@register("cispo", options={"eps_low": number(ge=0, none_ok=True), "eps_high": NONNEG, **CORRECTION_OPTIONS},
          metrics=CORRECTION_METRICS)
def cispo(
    logprobs, behavior_logprobs, advantages, mask, *, eps_low: float | None = None, eps_high: float = 4.0,
    **options,
) -> ObjectiveOutput:
    """CISPO (MiniMax-M1, arXiv 2506.13585; docs/design/objectives.md §3.6): ℓ_t = −sg(clip(r, 1−ε_l, 1+ε_h))·A·log π_θ.

    Every token keeps its gradient. ``eps_low=None`` (default) means no lower bound (0), as the
    paper effectively uses; the default upper bound 1 + 4 = 5. Supports ``old_logprobs`` and
    ``correction`` like ``grpo``.
    """
    def per_token(prep: Prepared, old: torch.Tensor, metrics: dict):
        c = prep.opts.log_ratio_clip
        r = (prep.logprobs.detach() - old).clamp(-c, c).exp()
        low = 0.0 if eps_low is None else 1.0 - eps_low
        high = 1.0 + eps_high
        return -r.clamp(low, high) * prep.advantages * prep.logprobs, (r > high) | (r < low)

    return _surrogate("cispo", logprobs, behavior_logprobs, advantages, mask, options, per_token)


@register("gspo", options={"eps_low": NONNEG, "eps_high": NONNEG, **CORRECTION_OPTIONS},
          metrics={**CORRECTION_METRICS, "seq_ratio_mean": TOKEN_MEAN})
def gspo(
    logprobs, behavior_logprobs, advantages, mask, *, eps_low: float = 3e-4, eps_high: float = 4e-4,
    aggregation: str = "seq_mean_token_mean", **options,
) -> ObjectiveOutput:
    """GSPO, token form (arXiv 2507.18071; docs/design/objectives.md §3.5).

    s_i = exp((1/|y_i|) Σ_t log r_i,t) is the length-normalised sequence ratio; each token uses
    s_i,t = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)) (value s_i, gradient s_i·∇log π_θ) in the PPO clip, so a
    whole sequence is clipped together. Default aggregation: sequence mean of token means, which
    equals the GSPO sequence objective when the advantage is constant over a sequence.
    Supports ``old_logprobs`` and ``correction`` like ``grpo``.
    """
    def per_token(prep: Prepared, old: torch.Tensor, metrics: dict):
        c = prep.opts.log_ratio_clip
        lens = prep.maskf.sum(1, keepdim=True).clamp_min(1.0)
        seq_lr = ((prep.logprobs.detach() - old) * prep.maskf).sum(1, keepdim=True) / lens
        s = seq_lr.clamp(-c, c).exp()
        # each sequence's ratio weighted by its tokens: the learner's token-mean reduction then gives the whole batch's
        metrics["seq_ratio_mean"] = (s * lens * prep.mask.any(1, keepdim=True)).sum() / prep.maskf.sum().clamp_min(1)
        s_tok = s * torch.exp(prep.logprobs - prep.logprobs.detach())
        return ppo_clip_per_token(s_tok, prep.advantages, eps_low, eps_high, None)

    return _surrogate("gspo", logprobs, behavior_logprobs, advantages, mask, {**options, "aggregation": aggregation},
                      per_token)


@register("reinforce", options={"importance_weight": FLAG, **CORRECTION_OPTIONS}, metrics=CORRECTION_METRICS)
def reinforce(
    logprobs, behavior_logprobs, advantages, mask, *, importance_weight: bool = True, **options,
) -> ObjectiveOutput:
    """Importance-weighted REINFORCE: ℓ_t = −sg(ρ_t)·A·log π_θ, ρ_t = π_θ/π_b (no cap, no clip).

    Its gradient is ρ·A·∇log π_θ, the unbiased off-policy policy gradient (per token). With
    ``importance_weight=False`` the weight is 1 (on-policy REINFORCE). A reference for the others:
    P3O on on-policy data equals this (docs/design/objectives.md §1.2 Limits).
    """
    def per_token(prep: Prepared, old: torch.Tensor, metrics: dict):
        c = prep.opts.log_ratio_clip
        weight = (prep.logprobs.detach() - old).clamp(-c, c).exp() if importance_weight else torch.ones_like(old)
        return -weight * prep.advantages * prep.logprobs, None

    return _surrogate("reinforce", logprobs, behavior_logprobs, advantages, mask, options, per_token)
