"""KL estimators: single-sample ones at the sampled token, and the exact full-distribution KL.

Sampled-token estimators (Schulman, http://joschu.net/blog/kl-approx.html).

All take ``log_ratio`` = log π_θ(y_t) − log π_other(y_t), shape [B, T], with gradient through π_θ,
and return a per-token value of the same shape. With x = log_ratio and r = π_other/π_θ = e^{−x}:

- ``k1`` = −log r = x. Unbiased for KL(π_θ‖π_other) on π_θ samples; can be negative.
- ``k2`` = ½ (log r)² = ½ x². Biased (second order), ≥ 0; gradient x·∇log π_θ.
- ``k3`` = (r − 1) − log r = e^{−x} − 1 + x. ≥ 0. The estimator of the P3O reference code
  (FeynRL algs/RL/common.py ``compute_kl_distance``) and of GRPO's reference KL (arXiv 2402.03300).
  On samples from π_b its expectation is χ²(π_b‖π_θ) − KL(π_b‖π_θ), and its gradient is
  (1 − 1/ρ)·∇log π_θ (docs/design/objectives.md §1.3, §5).

Callers clamp ``log_ratio`` first (see ``log_ratio_clip``), which makes the k3 gradient 0, not
reversed, beyond the bound (the reference's ±10 exponent clamp reverses it; docs/design/objectives.md §1.3 item 3).

``exact_kl`` sums over the vocabulary instead: KL(π_θ‖π_b) at each position, the term P3O's paper
writes (arXiv 2605.12380, Eq. 12). It needs both policies' full log-probs ``[B, T, V]`` (the learner passes them a
chunk of positions at a time, ``policy.chunked_logprobs``). ``top_k_kl_lower_bound`` needs only π_b's top-k
log-probs (what an engine such as vLLM returns) and is a lower bound on it.
"""

from __future__ import annotations

import torch


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio * log_ratio


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision near log_ratio = 0, where the value is ~x²/2.
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}
# Estimators that need the full distributions, not the sampled-token log-ratio (P3O's ``kl=`` only).
FULL_KL_ESTIMATORS = ("exact",)


def exact_kl(logprobs_full: torch.Tensor, behavior_logprobs_full: torch.Tensor) -> torch.Tensor:
    """Exact KL(π_θ‖π_b) per position: Σ_v π_θ(v|c_t) · (log π_θ(v|c_t) − log π_b(v|c_t)).

    The behaviour-KL term of P3O as the paper writes it (arXiv 2605.12380, Eq. 12: KL(π_θ‖π_b) of
    the whole next-token distribution), rather than a single-sample estimate at the sampled token.

    Its gradient w.r.t. the learner's logits z is ∂KL_t/∂z_u = π_θ(u)·(log π_θ(u) − log π_b(u) − KL_t)
    (softmax Jacobian), bounded by 2·max_v |log π_θ(v) − log π_b(v)| whatever the sampled token's
    ratio: k3's gradient (1 − 1/ρ)·∇log π_θ grows like 1/ρ as ρ → 0.

    Args:
        logprobs_full: [B, T, V] log π_θ (a log-softmax over the vocabulary), with gradient; finite.
        behavior_logprobs_full: [B, T, V] log π_b of the distribution the tokens were sampled from
            (temperature applied), no gradient needed. Must be finite wherever π_θ > 0: a truncated
            π_b (top-p, top-k: log π_b = −inf) makes the KL infinite, which the caller must refuse.

    Returns:
        [B, T] in nats, ≥ 0 up to rounding. Where π_θ(v) underflows to 0 the term is 0 (0·log 0 = 0).
    """
    p = logprobs_full.exp()
    # Zero the difference (not only the product) where p == 0: p·(±inf) would be NaN in the
    # forward and 0·inf in the backward.
    diff = torch.where(p > 0, logprobs_full - behavior_logprobs_full, torch.zeros((), dtype=p.dtype))
    return (p * diff).sum(-1)


# Q_o, the behaviour's mass outside its top k, is 1 − Σ exp(top-k log-probs): an engine's float32 log-probs fix it only
# to ~2^-23. Below that it is floored there: a larger Q_o lowers P_o·log(P_o/Q_o) (a float32 sum over 1 + 1e-7 would
# otherwise give Q_o = 0 and a tail term of P_o·87 nats, an artefact). The rounding can still leave Q_o under the true
# tail mass where that is near k·2^-24: the value is a bound to float32's resolution of the tail (objectives.md §8).
Q_OTHER_FLOOR = 2.0**-23


def top_k_reference(logprobs_full: torch.Tensor, behavior_top_logprobs: torch.Tensor,
                    behavior_top_ids: torch.Tensor) -> torch.Tensor:
    """The distribution r whose exact KL(π_θ‖r) is ``top_k_kl_lower_bound``: log r [..., V], no gradient.

    r = π_b on the k tokens S given, and π_b's remaining mass Q_o spread over the rest in proportion to π_θ:
    r(v) = Q_o·p(v)/P_o outside S (p = π_θ, P_o = Σ_{v∉S} p(v)). Then Σ_{v∉S} p(v)·log(p(v)/r(v)) = P_o·log(P_o/Q_o),
    the "other" bucket's term, so ``exact_kl(lp, r)`` is the coarse-grained KL; and with r held fixed its gradient
    w.r.t. the logits, p_u·(log p_u − log r_u − KL), is the coarse-grained KL's own (the softmax Jacobian of
    Σ_b P_b·log(P_b/Q_b) over the buckets b: r's dependence on p adds Σ_{v∉S} p(v)·∂log(p(v)/P_o) = 0). So an
    exact-KL path that takes log π_b per chunk (``policy.chunked_logprobs``) takes this r and computes the bound
    and its gradient unchanged.

    Args:
        logprobs_full: [..., V] log π_θ (a log-softmax), used without gradient (detached here).
        behavior_top_logprobs: [..., k] log π_b of k distinct tokens (temperature applied).
        behavior_top_ids: [..., k] long, those tokens' ids.

    Returns:
        [..., V] log r in ``logprobs_full``'s dtype: finite wherever π_θ > 0 (−inf outside S where π_θ
        underflows to 0, where the KL's term is 0). Q_o is floored at ``Q_OTHER_FLOOR``.
    """
    lp = logprobs_full.detach()
    top = behavior_top_logprobs.to(lp.dtype)
    r = lp.scatter(-1, behavior_top_ids, float("-inf"))
    log_p_o = torch.logsumexp(r, -1, keepdim=True)  # −inf when k = V or π_θ has no mass outside S
    q_o = (1.0 - top.exp().sum(-1, keepdim=True)).clamp_min(Q_OTHER_FLOOR)
    shift = torch.where(torch.isfinite(log_p_o), q_o.log() - log_p_o, torch.zeros((), dtype=lp.dtype))
    return r.add_(shift).scatter_(-1, behavior_top_ids, top)


def top_k_kl_lower_bound(logprobs_full: torch.Tensor, behavior_top_logprobs: torch.Tensor,
                         behavior_top_ids: torch.Tensor) -> torch.Tensor:
    """A lower bound on KL(π_θ‖π_b) per position from π_b's top-k log-probs, the rest of its mass as one bucket.

    With S the k tokens given, p = π_θ, q = π_b, P_o = 1 − Σ_{v∈S} p(v) and Q_o = 1 − Σ_{v∈S} q(v):

        KL_k = Σ_{v∈S} p(v)·(log p(v) − log q(v)) + P_o·log(P_o / Q_o)

    the exact KL of the two distributions coarse-grained to S plus an "other" bucket. Its bias is exactly
    KL_k − KL = −P_o·KL(p(·|not S) ‖ q(·|not S)) ≤ 0 (the chain rule of KL over the partition; Cover & Thomas,
    Elements of Information Theory, Thm 2.5.3 and the log-sum inequality): a lower bound, equal to the KL when
    k = V (no "other") or when p/q is constant outside S. It is tight when π_θ puts little mass outside S (P_o
    small) or has the same shape as π_b there; it misses what π_θ does inside π_b's tail. With float32 top-k
    log-probs it is a bound to float32's resolution of π_b's tail: where Q_o is near k·2^-24 the rounding can
    leave Q_o below its true value and the value above the KL (``Q_OTHER_FLOOR``; objectives.md §8).

    Computed as ``exact_kl(logprobs_full, top_k_reference(...))``: value and gradient are the coarse-grained KL's
    (``top_k_reference``).

    Args:
        logprobs_full: [..., V] log π_θ (a log-softmax), with gradient.
        behavior_top_logprobs: [..., k] log π_b of k distinct tokens (the engine's top-k, temperature applied).
        behavior_top_ids: [..., k] long, those tokens' ids.

    Returns:
        [...] in nats, ≥ 0 up to rounding; gradient through π_θ only. Q_o below ``Q_OTHER_FLOOR`` is taken as
        the floor (still a lower bound); where π_θ puts mass outside S while π_b has almost none the value is
        large.
    """
    return exact_kl(logprobs_full, top_k_reference(logprobs_full, behavior_top_logprobs, behavior_top_ids))


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` by name; raises ValueError for an unknown name."""
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}") from None
    return fn(log_ratio)
