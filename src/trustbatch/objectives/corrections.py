"""Train/inference mismatch corrections that compose with the clipped objectives (docs/design/objectives.md §3.9).

The weight compares the trainer's log-probs at the rollout's parameters (π_learner(θ_old), passed as
``old_logprobs``) with the inference engine's (μ, ``behavior_logprobs``): k = π_learner/μ.

Token level, k_t = π_learner(y_t)/μ(y_t):

- ``tis_token``:  w_t = min(k_t, cap)                       TIS (Yao et al. 2025, fengyao.notion.site/off-policy-rl); cap 2 as verl/slime
- ``mis_token``:  w_t = k_t if low ≤ k_t ≤ high else 0      IcePop (Ling Team, arXiv 2510.18855): the importance
  weight is kept inside the band and masked outside, as verl's IcePop mode and TRL's
  ``vllm_importance_sampling_mode="token_mask"`` compute it; band [0.5, 5]
- ``rej_token``:  w_t = 1 if low ≤ k_t ≤ high else 0        token rejection: no importance weight, only the mask
  (verl's ``token_k1`` rejection sampling)

Sequence level, one k_i per sequence i copied to its tokens, with two reductions:

- product:   k_i = exp(Σ_t log k_t) = Π_t k_t     (the sequence likelihood ratio; what TRL's and verl's
  sequence modes use)
- geomean:   k_i = exp(mean_t log k_t)             (length-normalised; trustbatch's default)

- ``tis_sequence_product``, ``tis_sequence_geomean``: w_i = min(k_i, cap)
- ``mis_sequence_product``, ``mis_sequence_geomean``: w_i = k_i if k_i ≤ cap else 0 (sequence rejection,
  arXiv 2510.26788 §4; the product form is TRL's ``sequence_mask``)
- ``tis_sequence`` and ``mis_sequence`` are aliases of the **geomean** forms (the historical default);
  ``seq_reduce="sum"`` turns an alias into the product form ("mean" keeps the geomean).

Σ_t log k_t is clamped to ±log_ratio_clip before exp, like every log ratio here, so a long sequence
cannot overflow the product. All weights are detached.

Masking kinds (``mis_*``, ``rej_token``) return the tokens they keep; with ``count_rejected=False``
the objective drops rejected tokens from the loss denominator as well (verl's rejection modifies the
response mask). See ``trustbatch.objectives.clipped`` for how that interacts with ``num_tokens``.
"""

from __future__ import annotations

import torch

SEQ_REDUCES = ("mean", "sum")
_KINDS = {
    # name: (rule, level, sequence reduction)
    "tis_token": ("tis", "token", None),
    "mis_token": ("mis_band", "token", None),
    "rej_token": ("rej_band", "token", None),
    "tis_sequence_product": ("tis", "sequence", "sum"),
    "tis_sequence_geomean": ("tis", "sequence", "mean"),
    "mis_sequence_product": ("mis_cap", "sequence", "sum"),
    "mis_sequence_geomean": ("mis_cap", "sequence", "mean"),
    "tis_sequence": ("tis", "sequence", None),
    "mis_sequence": ("mis_cap", "sequence", None),
}
CORRECTIONS = tuple(_KINDS)
# kinds that give some tokens weight 0 (and so may drop them from the denominator)
REJECTING = tuple(k for k, (rule, _, _) in _KINDS.items() if rule != "tis")


def resolve_kind(kind: str, seq_reduce: str | None = None) -> tuple[str, str, str | None]:
    """``(rule, level, reduction)`` of a correction; aliases resolved with ``seq_reduce``.

    Raises:
        ValueError: unknown kind or seq_reduce; a seq_reduce that contradicts a named kind or is
            given for a token-level kind.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown correction {kind!r}; choose one of {CORRECTIONS}")
    if seq_reduce is not None and seq_reduce not in SEQ_REDUCES:
        raise ValueError(f"seq_reduce={seq_reduce!r} must be 'mean' (geometric mean) or 'sum' (product)")
    rule, level, red = _KINDS[kind]
    if seq_reduce is not None:
        if level == "token":
            raise ValueError(f"correction {kind!r} is token level; seq_reduce does not apply")
        if red is not None and red != seq_reduce:
            raise ValueError(f"correction {kind!r} already fixes the sequence reduction; drop seq_reduce={seq_reduce!r}")
        red = seq_reduce
    if level == "sequence" and red is None:
        red = "mean"
    return rule, level, red


def correction_weights(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    *,
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 5.0),
    seq_reduce: str | None = None,
    log_ratio_clip: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Detached per-token weights ``[B, T]`` (0 at masked positions), the kept tokens, and metrics.

    old_logprobs, behavior_logprobs: [B, T], already zeroed at masked positions; mask: [B, T] bool.
    Returns ``(w, kept, metrics)``: ``kept`` [B, T] bool is ``mask`` minus the tokens a masking kind
    rejects (``mask`` itself for TIS). Metrics: ``correction_weight_mean`` and
    ``correction_zeroed`` (fraction of valid tokens rejected) or ``correction_capped`` (fraction
    whose weight hit the cap).

    Raises:
        ValueError: unknown ``kind`` or ``seq_reduce`` (see ``resolve_kind``), a cap ≤ 0, or a band
            with low > high or low < 0.
    """
    rule, level, red = resolve_kind(kind, seq_reduce)
    low, high = band
    if not 0 <= low <= high:
        raise ValueError(f"correction band {tuple(band)} must satisfy 0 ≤ low ≤ high")
    if not cap > 0:
        raise ValueError(f"correction cap must be > 0, got {cap}")
    m = mask
    mf = m.to(old_logprobs.dtype)
    lk = torch.where(m, old_logprobs.detach() - behavior_logprobs.detach(), 0.0)
    if level == "sequence":
        s = lk.sum(1)
        if red == "mean":
            s = s / mf.sum(1).clamp_min(1.0)
        lk = s[:, None].expand_as(lk)
    k = lk.clamp(-log_ratio_clip, log_ratio_clip).exp()
    n = mf.sum().clamp_min(1.0)
    metrics = {}
    if rule == "tis":
        w = k.clamp(max=cap)
        keep = torch.ones_like(m)
        metrics["correction_capped"] = ((k > cap) & m).sum() / n
    else:
        keep = (k >= low) & (k <= high) if rule in ("mis_band", "rej_band") else k <= cap
        w = torch.where(keep, k if rule != "rej_band" else torch.ones_like(k), 0.0)
        metrics["correction_zeroed"] = (~keep & m).sum() / n
    w = torch.where(m, w, 0.0)
    metrics["correction_weight_mean"] = (w * mf).sum() / n
    return w, keep & m, metrics
