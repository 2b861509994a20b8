"""Shared plumbing for the objectives: input checks, masking, aggregation, regularisers, metrics.

Every objective follows the same tensor contract (docs/design/objectives.md §0):
``logprobs``, ``behavior_logprobs``, ``advantages`` and ``mask`` are ``[B, T]``; only ``logprobs``
carries gradient; ``mask`` marks valid response tokens. Masked positions may hold anything,
including inf and NaN: they are replaced by 0 *before* any arithmetic, so that 0·inf never
produces NaN in the forward or the backward pass.

No silent NaN or inf: every objective either raises ValueError or returns a finite loss, and a
finite gradient w.r.t. ``logprobs`` (else the backward pass raises ValueError, or, inside
``deferred_grad_refusals``, gives a zero gradient and keeps the message). The forward checks
cost no host synchronisation beyond the one ``finish`` makes for the metrics; the gradient check
costs one in the backward pass (``_GradGuard``), where the loss's backward is a few small kernels.
"""

from __future__ import annotations

import contextlib
import math
from numbers import Real
from dataclasses import dataclass, field, fields, replace

import torch

from .kl import kl_estimate

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
ESS_SCOPES = ("batch", "micro_batch", "sequence")
DEFAULT_LOG_RATIO_CLIP = 20.0
# exp(80) ≈ 5.5e34 stays finite in float32 (max ≈ 3.4e38, e^88.7); a larger bound lets ρ overflow.
MAX_LOG_RATIO_CLIP = 80.0


@dataclass
class ObjectiveOutput:
    """What every objective returns.

    loss: scalar tensor (the quantity to minimise, i.e. −J), differentiable w.r.t. ``logprobs``.
    metrics: plain floats for logging (no tensors, no gradient).
    """

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class CommonOptions:
    """Options every objective accepts besides its own.

    aggregation: "token_mean" (Σ m·ℓ / N), "seq_mean_token_mean" ((1/S) Σ_i mean_t ℓ_i,t) or
        "seq_mean_token_sum" ((1/S) Σ_i Σ_t ℓ_i,t / seq_constant, Dr.GRPO, arXiv 2503.20783).
    num_tokens: global N for "token_mean" (valid tokens over every micro-batch and rank of the
        optimizer step). None uses this call's own count. Passing the global N makes the losses of
        the micro-batches sum to the loss of the whole batch. It must be ≥ this call's count of
        valid tokens (ValueError otherwise); 0 is accepted only for a call with no valid token,
        whose loss is then 0.
    num_sequences: global S for the sequence aggregations; None counts this call's non-empty rows.
        Must be ≥ this call's non-empty rows, like ``num_tokens``.
    seq_constant: the Dr.GRPO constant (> 0); None uses T (the padded response length; 1 if T = 0). The trainer
        passes the generation budget, rollout.max_new_tokens (docs/design/objectives.md §3.4).
    log_ratio_clip: bound L on |log ρ| before exp (docs/design/objectives.md §1.8 item 3), in (0, 80]; tokens beyond it
        are counted in the ``log_ratio_clamped`` metric.
    ref_logprobs, ref_kl_coef, ref_kl: optional KL to a frozen reference policy, added per token
        as ref_kl_coef · k(logprobs − ref_logprobs) with estimator ``ref_kl`` (k1, k2, k3).
    entropy, entropy_coef: optional entropy bonus, subtracted per token (``entropy`` is [B, T],
        full-vocabulary entropy in nats).
    check_finite: raise on non-finite log-probs at valid positions (one host sync per call).
    """

    aggregation: str = "token_mean"
    num_tokens: float | None = None
    num_sequences: float | None = None
    seq_constant: float | None = None
    log_ratio_clip: float = DEFAULT_LOG_RATIO_CLIP
    ref_logprobs: torch.Tensor | None = None
    ref_kl_coef: float = 0.0
    ref_kl: str = "k3"
    entropy: torch.Tensor | None = None
    entropy_coef: float = 0.0
    check_finite: bool = True

    @classmethod
    def parse(cls, objective: str, options: dict) -> "CommonOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown option {unknown[0]!r} for objective {objective!r}; "
                f"it takes its own keywords plus {sorted(known)}"
            )
        opts = cls(**options)
        if opts.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={opts.aggregation!r} is not one of {AGGREGATIONS}")
        if not 0 < opts.log_ratio_clip <= MAX_LOG_RATIO_CLIP:
            raise ValueError(f"log_ratio_clip must be in (0, {MAX_LOG_RATIO_CLIP:g}], got {opts.log_ratio_clip}")
        for name in ("num_tokens", "num_sequences", "seq_constant"):
            v = getattr(opts, name)
            if v is not None and not (isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number ≥ 0 or None, got {v!r}")
        if opts.seq_constant is not None and opts.seq_constant <= 0:
            raise ValueError(f"seq_constant must be > 0, got {opts.seq_constant}")
        for name in ("ref_kl_coef", "entropy_coef"):
            if not math.isfinite(getattr(opts, name)):
                raise ValueError(f"{name} must be finite, got {getattr(opts, name)}")
        return opts


@dataclass
class Prepared:
    """Validated, sanitised inputs. Masked positions hold 0 in every float tensor."""

    logprobs: torch.Tensor  # [B, T], compute dtype, with gradient
    behavior_logprobs: torch.Tensor  # [B, T], detached
    advantages: torch.Tensor  # [B, T], detached
    mask: torch.Tensor  # [B, T] bool
    maskf: torch.Tensor  # [B, T] compute dtype
    log_ratio: torch.Tensor  # [B, T] log π_θ − log π_b, with gradient, unclamped
    opts: CommonOptions
    name: str = "objective"

    @property
    def count(self) -> torch.Tensor:
        return self.maskf.sum()

    def clamped_log_ratio(self) -> torch.Tensor:
        """log ρ clamped to ±log_ratio_clip. Gradient flows inside the bound, is 0 outside."""
        c = self.opts.log_ratio_clip
        return self.log_ratio.clamp(-c, c)

    def sanitize(self, name: str, t: torch.Tensor | None, *, grad: bool = False,
                 required: str = "") -> torch.Tensor | None:
        """Check the shape of an extra [B, T] input and zero it at masked positions. None stays None, unless
        ``required`` names the objective that needs it (then ValueError)."""
        if t is None:
            if required:
                raise ValueError(f"{required} needs {name} [B, T] (log-probs under the proximal policy, the one at "
                                 "the start of the epoch); got None")
            return None
        t = _as_2d(name, t, self.mask.shape)
        check_floating(name, t)
        t = t.to(self.logprobs.dtype)
        if not grad:
            t = t.detach()
        if self.opts.check_finite:
            _check_finite(name, t, self.mask)
        return torch.where(self.mask, t, torch.zeros((), dtype=t.dtype))

    def with_mask(self, mask: torch.Tensor) -> "Prepared":
        """The same inputs restricted to ``mask`` (a subset of ``self.mask``): 0 elsewhere."""
        mask = mask & self.mask
        zero = torch.zeros((), dtype=self.logprobs.dtype)
        z = lambda t: torch.where(mask, t, zero)  # noqa: E731
        return replace(self, logprobs=z(self.logprobs), behavior_logprobs=z(self.behavior_logprobs),
                       advantages=z(self.advantages), mask=mask, maskf=mask.to(self.maskf.dtype),
                       log_ratio=z(self.log_ratio))


_DEFERRED: list[list[str]] = []  # the open deferred_grad_refusals blocks' message lists, innermost last


@contextlib.contextmanager
def deferred_grad_refusals():
    """Within the block, a gradient the objectives' backward would refuse (``_GradGuard``) becomes a zero gradient
    and its one-line message is appended to the yielded list, instead of a ValueError raised mid-backward.

    For a data-parallel learner: a backward pass that stops halfway leaves DDP's gradient buckets or FSDP2's
    reduce-scatters unfinished on one rank while the others wait in them. With the refusal deferred, every rank
    runs its backward to the end, and the learner skips the step on all ranks. The objective's forward (and so
    the ``_GradGuard`` it builds) must run inside the block; the backward may run on another thread.
    """
    messages: list[str] = []
    _DEFERRED.append(messages)
    try:
        yield messages
    finally:
        _DEFERRED.remove(messages)


class _GradGuard(torch.autograd.Function):
    """Cast log-probs to the compute dtype; in backward, refuse a gradient the input dtype cannot hold.

    Two overflows escape any forward check: a gradient such as −w·A/(seq_constant·S) at a token
    with log p = 0 overflows while the loss term (·log p) is 0; and autograd casts the float32
    gradient back to float16 inputs, where |g| > 65504 becomes inf. Both raise here instead (or, inside
    ``deferred_grad_refusals``, give a zero gradient and a kept message).
    """

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.in_dtype = x.dtype
        ctx.deferred = _DEFERRED[-1] if _DEFERRED else None
        return x.to(dtype)

    @staticmethod
    def backward(ctx, g):
        big = float(g.abs().max()) if g.numel() else 0.0
        limit = torch.finfo(ctx.in_dtype).max
        if not big <= limit:
            message = (f"the gradient w.r.t. {ctx.in_dtype} logprobs reaches {big:.3g}, beyond that dtype's range "
                       f"({limit:.3g}); scale the advantages down, check num_tokens/seq_constant, or pass float32 "
                       "logprobs")
            if ctx.deferred is None:
                raise ValueError(message)
            ctx.deferred.append(message)
            return torch.zeros_like(g, dtype=ctx.in_dtype), None
        return g.to(ctx.in_dtype), None


QUANTILE_MAX_ELEMENTS = 2**24  # torch.quantile refuses larger inputs ("input tensor is too large")


def quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """The ``qs`` quantiles of a 1-D float tensor ``values`` [N], N ≥ 1, with linear interpolation between the
    sorted values at position q·(N − 1) (``torch.quantile``'s and NumPy's default): ``torch.quantile`` itself up
    to ``QUANTILE_MAX_ELEMENTS``, a sort above, where a learner step of many long completions gets."""
    q = torch.tensor(qs, dtype=values.dtype, device=values.device)
    if values.numel() <= QUANTILE_MAX_ELEMENTS:
        return torch.quantile(values, q)
    s = values.sort().values
    pos = q.double() * (values.numel() - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    return s[lo] + (s[hi] - s[lo]) * (pos - lo).to(values.dtype)


def _as_2d(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}; pass [B, T] tensors")
    return t


def check_floating(name: str, t: torch.Tensor) -> None:
    """Refuse a log-prob (or entropy) input whose dtype is not floating point, before any arithmetic.

    An integer or bool tensor (token ids passed by mistake) would give a loss and then torch's own
    error at backward; a complex one has no order for the clip. Raises ValueError naming ``name`` and the dtype.
    """
    if not t.is_floating_point():
        raise ValueError(f"{name} has dtype {t.dtype}; it must be a floating-point tensor (float32, float64, bfloat16 "
                         "or float16) of log-probabilities, not token ids or counts")


def _check_finite(name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
    bad = (~torch.isfinite(t)) & mask
    if bool(bad.any()):
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite values at valid (mask=True) positions; "
            "mask those tokens out or fix the log-prob computation"
        )


def prepare(
    objective: str,
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: dict,
) -> Prepared:
    """Validate the four standard inputs and return them sanitised.

    Shapes: all ``[B, T]``; ``advantages`` may also be ``[B]`` (a sequence scalar copied to every
    token). Compute dtype: float32, or float64 when ``logprobs`` is float64 (for gradcheck).

    Raises:
        ValueError: wrong type or shape, log-probs whose dtype is not floating point (integer, bool,
            complex), a mask that is not bool or 0/1, non-finite log-probs or advantages at valid
            positions, an unknown option.
    """
    opts = CommonOptions.parse(objective, options)
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs must be a [B, T] tensor, got "
            f"{tuple(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__}"
        )
    check_floating("logprobs", logprobs)
    shape = logprobs.shape
    if isinstance(advantages, torch.Tensor) and advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages[:, None].expand(shape)
    behavior_logprobs = _as_2d("behavior_logprobs", behavior_logprobs, shape)
    check_floating("behavior_logprobs", behavior_logprobs)
    advantages = _as_2d("advantages", advantages, shape)
    mask = _as_2d("mask", mask, shape)
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must be bool or hold only 0 and 1")
        mask = mask != 0
    mask = mask.to(logprobs.device)

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    if opts.check_finite:
        _check_finite("logprobs", logprobs.detach(), mask)
        _check_finite("behavior_logprobs", behavior_logprobs, mask)
        _check_finite("advantages", advantages, mask)
    lp = _GradGuard.apply(logprobs, dtype) if logprobs.requires_grad else logprobs.to(dtype)
    lp = torch.where(mask, lp, zero)
    blp = torch.where(mask, behavior_logprobs.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    return Prepared(
        logprobs=lp,
        behavior_logprobs=blp,
        advantages=adv,
        mask=mask,
        maskf=mask.to(dtype),
        log_ratio=lp - blp,
        opts=opts,
        name=objective,
    )


def with_budget_constant(options: dict, budget: int | None) -> dict:
    """``options`` with Dr.GRPO's constant L_const (``seq_constant``) set to the generation budget ``budget`` where
    the aggregation is ``seq_mean_token_sum`` and none is given (arXiv 2503.20783 §3.4; TRL's ``dr_grpo`` divides by
    ``max_completion_length``, verl by the responses' width, padded to the budget); else ``options`` as they are.
    Without it the objective divides by its input's padded width, the longest completion of each batch."""
    if options.get("aggregation") != "seq_mean_token_sum" or options.get("seq_constant") is not None or not budget:
        return options
    return {**options, "seq_constant": float(budget)}


def aggregate(per_token: torch.Tensor, prep: Prepared) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` (already 0 at masked positions) to a scalar.

    Modes (docs/design/objectives.md §3 shared conventions; §3.4 for Dr.GRPO): see ``CommonOptions.aggregation``.
    An all-masked input gives a zero loss that is still connected to the graph. A given
    ``num_tokens``/``num_sequences`` of 0 is replaced by 1: it can only be right for a call with no
    valid token (``finish`` raises otherwise), whose sum is 0 anyway.
    """
    o = prep.opts
    m = prep.maskf
    if o.aggregation == "token_mean":
        denom = (o.num_tokens or 1.0) if o.num_tokens is not None else prep.count.clamp_min(1.0)
        return per_token.sum() / denom
    lens = m.sum(dim=1)
    nseq = (o.num_sequences or 1.0) if o.num_sequences is not None else (lens > 0).sum().clamp_min(1).to(m.dtype)
    if o.aggregation == "seq_mean_token_mean":
        per_seq = per_token.sum(dim=1) / lens.clamp_min(1.0)
    else:
        const = o.seq_constant if o.seq_constant is not None else float(max(per_token.shape[1], 1))
        per_seq = per_token.sum(dim=1) / const
    return per_seq.sum() / nseq


def add_regularizers(per_token: torch.Tensor, prep: Prepared, metrics: dict) -> torch.Tensor:
    """Add the optional reference-KL penalty and entropy bonus (each 0 unless its coefficient is set)."""
    o = prep.opts
    for coef, tensor in (("ref_kl_coef", "ref_logprobs"), ("entropy_coef", "entropy")):
        if getattr(o, coef) != 0.0 and getattr(o, tensor) is None:
            raise ValueError(f"{coef}={getattr(o, coef)} needs the {tensor} tensor, which was not passed; "
                             f"pass {tensor}= or set {coef}=0")
    if o.ref_logprobs is not None and o.ref_kl_coef != 0.0:
        ref = prep.sanitize("ref_logprobs", o.ref_logprobs)
        c = o.log_ratio_clip
        k = kl_estimate((prep.logprobs - ref).clamp(-c, c), o.ref_kl)
        per_token = per_token + o.ref_kl_coef * k
        metrics["kl_ref"] = _masked_mean(k.detach(), prep)
    if o.entropy is not None:
        ent = prep.sanitize("entropy", o.entropy, grad=True)
        metrics["entropy"] = _masked_mean(ent.detach(), prep)
        if o.entropy_coef != 0.0:
            per_token = per_token - o.entropy_coef * ent
    return torch.where(prep.mask, per_token, torch.zeros((), dtype=per_token.dtype))


def _masked_mean(t: torch.Tensor, prep: Prepared) -> torch.Tensor:
    return (t * prep.maskf).sum() / prep.count.clamp_min(1.0)


def ratio_metrics(prep: Prepared, ratio: torch.Tensor, clip_eps: float = 0.2) -> dict:
    """Diagnostics shared by every objective, as 0-dim tensors (converted to floats once, at the end).

    ratio: [B, T] detached ρ = exp(clamped log ρ). Keys: ess (normalized ESS of this call's tokens,
    docs/design/objectives.md §1.1), ratio_p50/p99/max, abs_log_ratio_mean/max (|logprobs − behavior_logprobs|),
    log_ratio_clamped (fraction beyond ±log_ratio_clip), kl_behavior (k3 vs behaviour, token mean),
    clip_fraction (tokens a PPO clip of ``clip_eps`` would zero), num_tokens.
    """
    m = prep.mask
    lr = prep.log_ratio.detach()
    n = prep.count
    out: dict = {"num_tokens": n}
    vals = ratio[m]
    if vals.numel() == 0:
        z = torch.zeros((), dtype=ratio.dtype)
        out.update(ratio_p50=z + 1, ratio_p99=z + 1, ratio_max=z + 1, abs_log_ratio_mean=z,
                   abs_log_ratio_max=z, log_ratio_clamped=z, kl_behavior=z, clip_fraction=z, ess=z + 1)
        return out
    q = quantiles(vals.float(), (0.5, 0.99))
    alr = lr.abs()
    r64 = vals.double()
    s1, s2 = r64.sum(), (r64 * r64).sum()
    adv = prep.advantages
    clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
    out.update(
        ratio_p50=q[0],
        ratio_p99=q[1],
        ratio_max=vals.max(),
        abs_log_ratio_mean=(alr * prep.maskf).sum() / n,
        abs_log_ratio_max=alr.max(),
        log_ratio_clamped=((alr > prep.opts.log_ratio_clip) & m).sum() / n,
        kl_behavior=_masked_mean(kl_estimate(prep.clamped_log_ratio().detach(), "k3"), prep),
        clip_fraction=(clipped & m).sum() / n,
        ess=(s1 * s1 / (n.double() * s2)).clamp(max=1.0),
    )
    return out


def finish(loss: torch.Tensor, metrics: dict, prep: Prepared) -> ObjectiveOutput:
    """Convert tensor metrics to floats with a single host transfer, and check the result.

    Raises:
        ValueError: the loss is not finite (the per-token terms overflowed; the message gives the
            largest |advantage| to say by how much), or ``num_tokens``/``num_sequences`` is smaller
            than this call's own count of valid tokens/non-empty rows.
    """
    checks = {"_loss": loss.detach(), "_rows": (prep.mask.sum(1) > 0).sum(), "_count": prep.count,
              "_adv_max": prep.advantages.abs().max() if prep.advantages.numel() else prep.count * 0}
    keys = list(metrics) + list(checks)
    vals = [metrics[k] for k in metrics] + list(checks.values())
    tens = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
    floats = torch.stack([vals[i].detach().double().reshape(()).cpu() for i in tens]).tolist()
    for i, f in zip(tens, floats):
        vals[i] = f
    out = {k: float(v) for k, v in zip(keys, vals)}
    got = {k: out.pop(k) for k in checks}
    o = prep.opts
    for opt, count, what in ((o.num_tokens, got["_count"], "valid tokens"), (o.num_sequences, got["_rows"], "non-empty rows")):
        if opt is not None and opt < count:
            name = "num_tokens" if what == "valid tokens" else "num_sequences"
            raise ValueError(f"{prep.name}: {name}={opt:g} is smaller than this call's {count:g} {what}; "
                             f"pass the count over every micro-batch and rank of the optimizer step")
    if not math.isfinite(got["_loss"]):
        raise ValueError(f"{prep.name}: the loss is {got['_loss']} (largest |advantage| {got['_adv_max']:.3g}): "
                         f"the per-token terms overflow {loss.dtype}; scale the advantages or rewards down")
    out["loss"] = got["_loss"]
    return ObjectiveOutput(loss=loss, metrics=out)
