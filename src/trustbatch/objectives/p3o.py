"""P3O: the batch-adaptive objective of "Trust the Batch" (arXiv 2605.12380), and its two-anchor extension.

Per valid token (Eq. 12 per the read-through; docs/design/objectives.md §1.2):

    w_t = sg(min(ρ_t, e_B))                  one-sided cap, ρ_t = π_θ/π_b
    ℓ_t = −w_t · A_t · log π_θ(y_t)  +  (1 − e_B) · KL_t(π_θ ‖ π_b)
    ∂ℓ_t/∂log π_θ = −min(ρ_t, e_B)·A_t + (1 − e_B)·∂KL_t/∂log π_θ

with e_B = sg(ESS(B)) the normalized effective sample size of the batch's ratios (Eq. 11).
On-policy data (ρ ≡ 1) gives e_B = 1, so the update is token-mean REINFORCE with no KL.

KL_t is the sampled-token estimator ``kl`` = k3 (reference code), k2 or k1 of log ρ_t, or with
``kl="exact"`` the full-distribution KL(π_θ(·|c_t) ‖ π_b(·|c_t)) the paper writes (``kl.exact_kl``),
from the learner's and the behaviour policy's full log-probs ``[B, T, V]``. The objective declares
that need at registration (``full_logprobs_when``), so the learner passes them and a caller that
cannot is refused by ``validate_options``.
"""

from __future__ import annotations

import torch

from ._common import (ESS_SCOPES, ObjectiveOutput, Prepared, _check_finite, add_regularizers, aggregate, check_floating,
                      finish, prepare, ratio_metrics)
from .kl import FULL_KL_ESTIMATORS, KL_ESTIMATORS, exact_kl, kl_estimate
from .ratio_stats import RatioStats
from .metrics import SUM, TOKEN_MEAN, RatioOf
from .registry import choice, register

# A token counts as capped (``cap_fraction``) only when the cap changes its weight by more than this
# relative amount: ρ > e·(1 + CAP_RTOL). Recomputing log-probs in float32 moves them by ~1e-6
# (ε_f32 ≈ 1.2e-7 times |log p| ≲ 10), so on-policy data has ρ = 1 ± 1e-6 against e = 1 − 1e-12
# and would otherwise report up to half its tokens as capped. 1e-4 is 100× that noise, and a
# cap that moves a weight by less than 0.01 % does not change the update in any way that matters.
CAP_RTOL = 1e-4
_KL = choice(sorted(KL_ESTIMATORS) + list(FULL_KL_ESTIMATORS))
_FULL_WHEN = {"kl": FULL_KL_ESTIMATORS}
# policy_loss and kl_loss are aggregated with the caller's global num_tokens/num_sequences, like the loss;
# ess_fallback counts calls
_P3O_METRICS = {"cap_fraction": TOKEN_MEAN, "cap_removed_weight": TOKEN_MEAN, "score_weight": TOKEN_MEAN,
                "cap_weight_removed": RatioOf("cap_removed_weight", "score_weight"), "kl_weight": TOKEN_MEAN,
                "policy_loss": SUM, "kl_loss": SUM, "ess_fallback": SUM}
# |logsumexp| beyond this at a valid position means the input is not a log-softmax (float32 log-softmax
# over 1e5 entries is normalised to ~1e-5).
_NORM_TOL = 1e-3


def _full_input(prep: Prepared, name: str, t, V: int | None = None) -> torch.Tensor:
    """Check a [B, T, V] log-prob input, cast it to the compute dtype and zero it at masked positions; every input
    but the policy's own ``logprobs_full`` is detached."""
    B, T = prep.mask.shape
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[:2]) != (B, T) or (V is not None and t.shape[2] != V):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        want = f"[{B}, {T}, {V if V is not None else 'V'}]"
        raise ValueError(f"{name} has shape {got}; kl='exact' needs {want} full log-probs at the response positions")
    if t.shape[2] == 0:
        raise ValueError(f"{name} has an empty vocabulary dimension; pass the full log-softmax over the vocabulary")
    check_floating(name, t)
    m3 = prep.mask[..., None]
    if prep.opts.check_finite:
        if name == "behavior_logprobs_full" and bool(((t.detach() == float("-inf")) & m3).any()):
            raise ValueError("behavior_logprobs_full is -inf at valid positions: a truncated behaviour distribution "
                             "(top-p or top-k) puts π_b = 0 where π_θ > 0, so KL(π_θ‖π_b) is infinite; "
                             "sample with top_p=1 or use kl='k3'")
        _check_finite(name, t.detach(), m3.expand_as(t))
        lse = torch.logsumexp(t.detach().double(), -1)
        off = float(torch.where(prep.mask, lse.abs(), 0.0).max()) if prep.mask.any() else 0.0
        if off > _NORM_TOL:
            raise ValueError(f"{name} is not normalised (|logsumexp| up to {off:.3g} at valid positions); "
                             "pass log_softmax over the vocabulary")
    # π_b and the proximal policy are constants of the loss (Eq. 12, a stop-gradient), as the [B, T] inputs are
    t = (t if name == "logprobs_full" else t.detach()).to(prep.logprobs.dtype)
    return torch.where(m3, t, torch.zeros((), dtype=t.dtype))


def _kl_exact_input(prep: Prepared, kl_exact, kl: str, **full) -> torch.Tensor | None:
    """The checked per-token exact KL ``[B, T]`` (with gradient) a caller computed itself; None if not given.

    Raises ValueError when it comes with another estimator or with the full inputs, has the wrong
    shape, or is not finite at a valid position.
    """
    if kl_exact is None:
        return None
    if kl not in FULL_KL_ESTIMATORS:
        raise ValueError(f"kl_exact is only used by kl='exact', not kl={kl!r}; drop it or set kl='exact'")
    given = sorted(k for k, v in full.items() if v is not None)
    if given:
        raise ValueError(f"pass kl_exact or the full log-probs ({', '.join(given)}), not both")
    if prep.opts.check_finite and isinstance(kl_exact, torch.Tensor) and kl_exact.shape == prep.mask.shape:
        if bool(((kl_exact.detach() == float("inf")) & prep.mask).any()):
            raise ValueError("kl_exact is +inf at valid positions: a truncated behaviour distribution (top-p or "
                             "top-k) puts π_b = 0 where π_θ > 0, so KL(π_θ‖π_b) is infinite; sample with top_p=1 "
                             "or use kl='k3'")
    return prep.sanitize("kl_exact", kl_exact, grad=True)


def _exact_kl_inputs(prep: Prepared, kl: str, **full) -> dict[str, torch.Tensor] | None:
    """The checked [B, T, V] inputs for ``kl="exact"``; None for a sampled-token estimator (which takes none)."""
    given = sorted(k for k, v in full.items() if v is not None)
    if kl not in FULL_KL_ESTIMATORS:
        if given:
            raise ValueError(f"{given[0]} is only used by kl='exact', not kl={kl!r}; drop it or set kl='exact'")
        return None
    missing = sorted(k for k, v in full.items() if v is None)
    if missing:
        raise ValueError(f"kl='exact' needs {', '.join(missing)}= ([B, T, V] log-softmax at the response positions) "
                         "or kl_exact= (the per-token KL); pass them or use kl='k3'")
    # the learner's own tensor first: its vocabulary is the one the others must match
    order = ["logprobs_full"] + sorted(k for k in full if k != "logprobs_full")
    V = full["logprobs_full"].shape[-1] if isinstance(full["logprobs_full"], torch.Tensor) else None
    return {k: _full_input(prep, k, full[k], V) for k in order}


def _resolve_ess(
    ess, scope: str, ratio: torch.Tensor, prep: Prepared, name: str = "ess"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(e, fallbacks)``: e is a 0-dim tensor (batch/micro-batch) or [B, 1] (sequence).

    ``ess`` given by the caller wins (a float, a RatioStats, or a [B]/[B, 1] tensor for sequence
    scope). Otherwise it is computed from this call's tokens: for "batch" and "micro_batch" that
    is the whole input (the trainer passes the batch value when it splits a batch).
    """
    dtype = prep.logprobs.dtype
    # A 0-dim e is kept in float64: 0-dim tensors do not promote, so the loss stays in ``dtype``,
    # while the logged ESS keeps the digits that tell 1 − 1e-8 (a bf16 rollout) from exactly 1.
    if scope not in ESS_SCOPES:
        raise ValueError(f"ess_scope={scope!r} is not one of {ESS_SCOPES}")
    if isinstance(ess, RatioStats):
        e, fb = ess.ess()
        return torch.tensor(e, dtype=torch.float64), torch.tensor(float(fb))
    if isinstance(ess, torch.Tensor) and ess.numel() > 1:
        if scope != "sequence":
            raise ValueError(f"{name} has {ess.numel()} values, but ess_scope={scope!r} takes one (a float, a 0-dim "
                             "tensor or RatioStats); per-row values are for ess_scope='sequence'")
        e = ess.detach().to(dtype).reshape(-1, 1)
        if e.shape[0] != ratio.shape[0]:
            raise ValueError(f"{name} has {e.shape[0]} rows but the batch has {ratio.shape[0]}; pass [B] or a scalar")
        rows = prep.mask.any(1, keepdim=True)
        bad = rows & ~((e >= 0) & (e <= 1))  # also true for NaN
        if bool(bad.any()):
            raise ValueError(f"{name} has {int(bad.sum())} rows outside [0, 1] or not finite at non-empty rows; "
                             "pass the normalized per-row ESS")
        # rows without a valid token may hold anything (padding): their weight multiplies zeros
        return torch.where(rows, e, 1.0), torch.tensor(0.0)
    if ess is not None:
        e = float(ess)
        if not (0.0 <= e <= 1.0):
            raise ValueError(f"{name}={e} is outside [0, 1]; pass the normalized ESS (RatioStats.ess())")
        return torch.tensor(e, dtype=torch.float64), torch.tensor(0.0)
    if scope == "sequence":
        r = torch.where(prep.mask, ratio.double(), 0.0)
        s1, s2, n = r.sum(1), (r * r).sum(1), prep.mask.sum(1).double()
        e = s1 * s1 / (n * s2)
        bad = (n < 0.5) | ~torch.isfinite(e)
        e = torch.where(bad, 1.0, e).clamp(max=1.0)
        # An empty row is padding, not a fallback worth counting.
        fb = (bad & (n > 0.5)).sum().double()
        return e.to(dtype)[:, None], fb
    e, fb = RatioStats.from_ratio(ratio, prep.mask).ess()
    return torch.tensor(e, dtype=torch.float64), torch.tensor(float(fb))


@register("p3o", batch_stats=("ess",), ess_scopes=ESS_SCOPES, options={"kl": _KL}, full_logprobs_when=_FULL_WHEN,
          metrics=_P3O_METRICS)
def p3o(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ess: float | RatioStats | torch.Tensor | None = None,
    ess_scope: str = "batch",
    kl: str = "k3",
    logprobs_full: torch.Tensor | None = None,
    behavior_logprobs_full: torch.Tensor | None = None,
    kl_exact: torch.Tensor | None = None,
    **options,
) -> ObjectiveOutput:
    """P3O loss (arXiv 2605.12380 Eq. 11–12; docs/design/objectives.md §1).

    Args:
        logprobs: [B, T] log π_θ(y_t|c_t), with gradient.
        behavior_logprobs: [B, T] log π_b(y_t|c_t) stored at sampling (temperature applied).
        advantages: [B, T] or [B], detached; a sequence scalar copied to every token.
        mask: [B, T] bool or 0/1, valid response tokens.
        ess: the batch ESS to use, when the caller computed it over more tokens than this call sees
            (the trainer's "batch" scope over micro-batches and ranks): a float in [0, 1], a
            ``RatioStats``, or for "sequence" scope a [B] tensor. None computes it from this call.
        ess_scope: "batch" (default; the whole optimizer batch), "micro_batch" (the reference
            code's choice: each micro-batch on its own) or "sequence" (one ESS per row).
        kl: behaviour-KL estimator, "k3" (reference code, default), "k2" or "k1" at the sampled token,
            or "exact": Σ_v π_θ(v)·(log π_θ(v) − log π_b(v)) per position (``kl.exact_kl``; the
            paper's KL(π_θ‖π_b), Eq. 12), whose gradient stays bounded as ρ → 0.
        logprobs_full: [B, T, V] log-softmax of the learner's logits at the response positions, with
            gradient (the same graph as ``logprobs``, which is its value at the sampled token);
            only with kl="exact".
        behavior_logprobs_full: [B, T, V] log π_b of the distribution actually sampled (temperature
            applied; no top-p/top-k truncation, where the KL is infinite); only with kl="exact".
        kl_exact: [B, T] the exact KL(π_θ‖π_b) per position in nats, with gradient through π_θ, computed
            by the caller (the learner's chunked LM head, ``policy.chunked_logprobs``, so that no
            [B, T, V] log-softmax of π_θ exists); only with kl="exact", instead of the two full inputs.
        **options: ``CommonOptions`` (aggregation, num_tokens, log_ratio_clip, ref KL, entropy).

    Returns:
        ObjectiveOutput; metrics add ``ess``, ``ess_fallback`` (count), ``cap_fraction`` (fraction
        of valid tokens the cap changes: ρ > e_B·(1 + CAP_RTOL), so float32 recomputation noise on
        on-policy data counts as 0), ``cap_weight_removed`` (the share of the score-function weight the cap
        removes, Σ|A_t|·(ρ_t − min(ρ_t, e_B)) / Σ|A_t|·ρ_t over valid tokens; 0 when every A_t = 0; its
        numerator and denominator per valid token are ``cap_removed_weight`` and ``score_weight``), ``kl_behavior`` (token mean of the chosen estimator), ``kl_weight`` (1 − e_B),
        ``policy_loss`` and ``kl_loss`` (the two terms, aggregated), and the shared ratio metrics.

    Raises:
        ValueError: bad shapes, mask values, non-finite log-probs at valid positions, an ``ess``
            outside [0, 1] (a per-row tensor: at a non-empty row, NaN included), an unknown scope,
            estimator or option; for kl="exact" a missing, misshapen, non-finite or unnormalised full
            input, or a −inf behaviour log-prob (truncated π_b); and the errors of ``finish`` (non-finite loss, ``num_tokens`` below
            this call's count).
    """
    prep = prepare("p3o", logprobs, behavior_logprobs, advantages, mask, options)
    given = dict(logprobs_full=logprobs_full, behavior_logprobs_full=behavior_logprobs_full)
    kl_t = _kl_exact_input(prep, kl_exact, kl, **given)
    full = _exact_kl_inputs(prep, kl, **given) if kl_t is None else None
    lr = prep.clamped_log_ratio()
    ratio = lr.detach().exp()
    e, fallbacks = _resolve_ess(ess, ess_scope, ratio, prep)
    if kl_t is None:
        kl_t = kl_estimate(lr, kl) if full is None else exact_kl(full["logprobs_full"], full["behavior_logprobs_full"])
    return _capped_pg_plus_kl(prep, ratio, e, kl_t, {"ess_fallback": fallbacks})


def _capped_pg_plus_kl(prep: Prepared, ratio: torch.Tensor, e: torch.Tensor, kl_t: torch.Tensor,
                       extra: dict) -> ObjectiveOutput:
    """ℓ_t = −sg(min(ρ_t, e))·A·log π_θ + (1 − e)·kl_t, aggregated, with the P3O metrics.

    ``e`` is 0-dim or [B, 1]; ``kl_t`` [B, T] carries gradient through log π_θ.
    """
    zero = torch.zeros((), dtype=ratio.dtype)
    weight = torch.minimum(ratio, e)  # ρ ≥ 0 already, so this is clamp(ρ, 0, e)
    policy_t = torch.where(prep.mask, -weight * prep.advantages * prep.logprobs, zero)
    kl_term_t = torch.where(prep.mask, (1.0 - e) * kl_t, zero)
    metrics = ratio_metrics(prep, ratio)
    per_token = add_regularizers(policy_t + kl_term_t, prep, metrics)
    loss = aggregate(per_token, prep)
    n = prep.count.clamp_min(1.0)
    e_mean = _mean_ess(e, prep)
    # cap_fraction counts tokens, which says little at high ESS: at e = 0.996 the cap "binds" on every
    # token with ρ > 0.996 while removing well under 1 % of the weight. The removed share of |A|·ρ says how
    # much of the score-function term the cap actually takes away.
    # float64: with a wide log_ratio_clip ρ reaches e^80, whose float32 sum overflows
    abs_adv = torch.where(prep.mask, prep.advantages.abs(), zero).double()
    full_sf = (ratio.double() * abs_adv).sum()
    removed = ((ratio - weight).double() * abs_adv).sum()
    metrics.update(
        ess=e_mean,
        cap_fraction=((ratio > e * (1.0 + CAP_RTOL)) & prep.mask).sum() / n,
        cap_weight_removed=removed / full_sf.clamp_min(torch.finfo(torch.float64).tiny),  # 0 ≤ removed ≤ full_sf: 0/tiny = 0
        # the two parts as token means, so that a learner can reduce them over micro-batches and ranks
        # exactly and divide once (declared RatioOf in _P3O_METRICS)
        cap_removed_weight=removed / n, score_weight=full_sf / n,
        kl_behavior=(kl_t.detach() * prep.maskf).sum() / n,
        kl_weight=1.0 - e_mean,
        policy_loss=aggregate(policy_t.detach(), prep),
        kl_loss=aggregate(kl_term_t.detach(), prep),
        **extra,
    )
    return finish(loss, metrics, prep)


def _mean_ess(e: torch.Tensor, prep: Prepared) -> torch.Tensor:
    """e itself, or in sequence scope each row's e weighted by its valid tokens (the weight its KL term carries per
    token), so that the learner's token-mean reduction over micro-batches and ranks gives the whole batch's mean."""
    if e.dim() == 0:
        return e
    return (e[:, 0] * prep.maskf.sum(1)).sum() / prep.maskf.sum().clamp_min(1)


@register("p3o_two_anchor", needs_proximal=True, batch_stats=("ess", "ess_proximal"), options={"kl": _KL},
          full_logprobs_when=_FULL_WHEN,
          metrics={**_P3O_METRICS, "ess_behavior": TOKEN_MEAN, "ess_proximal": TOKEN_MEAN})
def p3o_two_anchor(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor,
    ess: float | RatioStats | None = None,
    ess_proximal: float | RatioStats | None = None,
    kl: str = "k3",
    logprobs_full: torch.Tensor | None = None,
    behavior_logprobs_full: torch.Tensor | None = None,
    proximal_logprobs_full: torch.Tensor | None = None,
    kl_exact: torch.Tensor | None = None,
    **options,
) -> ObjectiveOutput:
    """Two-anchor P3O (arXiv 2605.12380 §3.1, Eq. 13, App. B per the read-through; docs/design/objectives.md §2). Experimental.

    Follows the reference code P4O (FeynRL algs/P4O/p4o.py), because the paper's exact e_mix is
    unverified:

        e_b = ESS(π_θ/π_b), e_p = ESS(π_θ/π_prox), e_mix = min(e_b, e_p)
        w_b = 1 − e_b, w_p = 1 − e_p
        log π_mix(y_t) = log[(w_b·π_b(y_t) + w_p·π_prox(y_t)) / (w_b + w_p)]   (sampled-token mixture)
        ℓ_t = −sg(min(ρ_b, e_mix))·A·log π_θ + (1 − e_mix)·KL_t(π_θ ‖ π_mix)

    When both anchors have ESS 1 the mixture weights are both 0; the KL coefficient (1 − e_mix)
    is then 0 too, and π_mix is taken as the even mixture. It reduces to P3O when π_prox = π_b.

    Args:
        proximal_logprobs: [B, T] log π_prox(y_t), no gradient (a snapshot at the start of the epoch).
        ess, ess_proximal: batch ESS of each anchor when computed by the caller: a float in [0, 1]
            or a ``RatioStats`` of π_θ/π_b (``ess``) and π_θ/π_prox (``ess_proximal``) over the whole
            optimizer batch. With both given and the global ``num_tokens``, the losses of the
            micro-batches sum to the loss of the whole batch. Others as ``p3o`` (batch scope only).
        logprobs_full, behavior_logprobs_full, proximal_logprobs_full: [B, T, V] log-softmax of
            π_θ (with gradient), π_b and π_prox, only with kl="exact": then π_mix is the mixture of
            the whole distributions, π_mix(v) = (w_b·π_b(v) + w_p·π_prox(v)) / (w_b + w_p), and
            KL_t = Σ_v π_θ(v)·(log π_θ(v) − log π_mix(v)).
        kl_exact: [B, T] that KL_t per position, with gradient, computed by the caller instead of the
            three full inputs (only with kl="exact"). π_mix's weights come from the ESS, so the caller
            must pass the ``ess`` and ``ess_proximal`` it mixed with (``anchor_log_weights``).

    Raises:
        ValueError: as ``p3o``; ``proximal_logprobs`` with a wrong shape or non-finite valid values.
    """
    prep = prepare("p3o_two_anchor", logprobs, behavior_logprobs, advantages, mask, options)
    given = dict(logprobs_full=logprobs_full, behavior_logprobs_full=behavior_logprobs_full,
                 proximal_logprobs_full=proximal_logprobs_full)
    kl_given = _kl_exact_input(prep, kl_exact, kl, **given)
    if kl_given is not None and (ess is None or ess_proximal is None):
        raise ValueError("kl_exact against π_mix needs the ess and ess_proximal its mixture weights came from; "
                         "pass both (anchor_log_weights gives the weights)")
    full = _exact_kl_inputs(prep, kl, **given) if kl_given is None else None
    prox = prep.sanitize("proximal_logprobs", proximal_logprobs, required="p3o_two_anchor")
    c = prep.opts.log_ratio_clip
    lr_b = prep.clamped_log_ratio()
    ratio_b = lr_b.detach().exp()
    ratio_p = (prep.logprobs.detach() - prox).clamp(-c, c).exp()
    e_b, fb_b = _resolve_ess(ess, "batch", ratio_b, prep)
    e_p, fb_p = _resolve_ess(ess_proximal, "batch", ratio_p, prep, name="ess_proximal")
    e_mix = torch.minimum(e_b, e_p)
    log_w_b, log_w_p, log_w = anchor_log_weights(e_b, e_p, lr_b.dtype)
    if kl_given is not None:
        kl_t = kl_given
    elif full is None:
        log_mix = torch.logaddexp(log_w_b + prep.behavior_logprobs, log_w_p + prox) - log_w
        kl_t = kl_estimate((prep.logprobs - log_mix).clamp(-c, c), kl)
    else:
        log_mix_full = torch.logaddexp(log_w_b + full["behavior_logprobs_full"],
                                       log_w_p + full["proximal_logprobs_full"]) - log_w
        kl_t = exact_kl(full["logprobs_full"], log_mix_full)
    return _capped_pg_plus_kl(prep, ratio_b, e_mix, kl_t,
                              {"ess_behavior": e_b, "ess_proximal": e_p, "ess_fallback": fb_b + fb_p})


def anchor_log_weights(e_b: torch.Tensor, e_p: torch.Tensor, dtype: torch.dtype):
    """(log w_b, log w_p, log(w_b + w_p)) of the two-anchor mixture π_mix, from the anchors' ESS.

    w_b = 1 − e_b, w_p = 1 − e_p (clamped at 0); both 0 (full trust in both anchors) → the even
    mixture, w_b = w_p = 1 (``p3o_two_anchor``; reference code P4O). e_b, e_p: 0-dim tensors (float64
    from a ``RatioStats``); ``dtype`` is that of the even mixture's weights (the loss's compute dtype).
    """
    w_b, w_p = (1.0 - e_b).clamp_min(0.0), (1.0 - e_p).clamp_min(0.0)
    if float(w_b + w_p) <= 0.0:
        w_b = w_p = torch.ones((), dtype=dtype)
    return torch.log(w_b), torch.log(w_p), torch.log(w_b + w_p)
