"""The LM head applied in chunks of response positions: log-probs, entropy and exact KL without [B, C, V] logits.

A chunk holds at most ``chunk_size`` tokens (rows × columns) of the micro-batch: hidden states
``[r, k, H]`` → logits ``[r, k, V]`` with r = min(B, chunk_size) rows and k = ⌊chunk_size / r⌋ columns
(``chunk_plan``), so one chunk's logits are at most chunk_size · V floats whatever B and C are. The
learner's default chunk is ``budget.logit_tokens(V)``: 256 MiB of float32 logits (441 tokens at
V = 151,936). A micro-batch whose full path fits in one chunk (B · (C + 1) ≤ chunk_size: the full path
computes C + 1 positions per row) keeps today's full path in the forwards (``forward.response_logprobs``,
``shared_prompt.grouped_response_logprobs``), op for op, so that short-completion jobs (the lab's C = 8)
give the same numbers bit for bit.

``chunked_logprobs`` is one ``torch.autograd.Function`` per block of rows: its forward computes each chunk's
logits, log-softmax, log-prob at the sampled token, entropy and exact KL, and frees them before the next
chunk; it saves only the hidden states, the head's weight (and bias) and the targets. Its backward
recomputes each chunk's logits and applies the log-softmax gradient analytically, accumulating the
weight's gradient over chunks. An entropy that enters the loss (an entropy bonus, ``entropy_grad``) gets its
gradient there too, written out per chunk; without it the backward runs the same ops as before. A head whose
weight and bias take no gradient (LoRA's frozen head, tied embeddings included) needs only the hidden states'
gradient, and for the log-probs alone that is g·(W_y − E_p[W])/T: the forward forms (W_y − E_p[W])/T per chunk
(one more product, p·W, the one the full path's backward runs) and saves it [B, C, H] in place of the hidden
states, so the backward is one multiplication, with no logits recomputed (two products of the head's size in
all, the full path's count, against three). A KL or an entropy with gradient takes the recomputing backward.
At most one chunk of [r, k, V] tensors (a few of them: logits,
log-softmax, probabilities, their gradient) is alive at any time. Values equal the full path's up to
float summation order (the weight's gradient sums chunk by chunk); the idea is torchtune's
``LinearCrossEntropyLoss`` and Liger Kernel's fused linear cross-entropy (chunked head + loss, the
backward recomputing the logits), here for RL's per-token log-probs whose upstream gradient is not
known in the forward.

Precision (the log-prob contract, shared by the forwards, the chunked path and the engine): log-probs are
computed from the logits upcast to ``logits_dtype`` = at least float32: float32 for bf16/fp16/fp32 models, float64
for a float64 model, as the full path does (scale-up invariant 1). The transformers engine's recorded behaviour
log-probs are float32 whatever the model: ``generate`` casts each step's logits to float32 before the processors.
Under autocast the backward recomputes the logits under the forward's autocast state.

The exact KL's reference π_ref enters as a ``KLReference`` and is read one chunk at a time. Its distributions are
either ``[B, C, V]`` log-prob tensors (a caller that has them) or ``TeacherForced``: the hidden states of a model
teacher-forced on the batch without gradient (the behaviour policy, the proximal snapshot) and its LM head, whose
log-softmax is computed per chunk and freed, so that no ``[B, C, V]`` tensor of π_ref exists. Rows whose engine
returned only its top-k log-probs (``TopKInput``) take, per chunk, the reference ``objectives.kl.top_k_reference``
builds from them and the chunk's own log-softmax: the KL there is the top-k lower bound, with its gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..objectives.kl import exact_kl, top_k_reference


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are computed in from logits of ``dtype``: at least float32 (float32 for bf16, fp16 and
    float32 logits, float64 for a float64 model's), the module docstring's contract."""
    return torch.promote_types(dtype, torch.float32)


def autocast_state(device_type: str, dtype: torch.dtype | None):
    """``dtype``'s autocast, or autocast off when None (a behaviour copy computes in its own dtype, also inside the
    learner's bf16-mixed step)."""
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


@dataclass(frozen=True)
class HeadInput:
    """One model's distribution at each response position of some rows, as its LM head's input.

    ``states`` [b, C, H]: the model's final hidden states at the positions that predict the response tokens
    (teacher-forced, no gradient), with ``head`` its LM head (any module: a quantized copy's too); or, for a model
    whose head cannot be split off (``forward.head_parts`` is None), its logits [b, C, V] with ``head`` None.
    ``rows``: long [b], the rows of the batch they belong to, or None for every row. ``temperature`` divides the
    logits, and ``autocast`` (a dtype or None: off) is the autocast state the head runs under, both as the model
    sampled (``forward.teacher_forced``).
    """

    states: torch.Tensor
    head: torch.nn.Module | None
    rows: torch.Tensor | None = None
    temperature: float = 1.0
    autocast: torch.dtype | None = None
    per_position = ("states",)  # the fields indexed by row and column (``TeacherForced``'s slicing)

    @torch.no_grad()
    def log_probs(self, cols: slice, lsm: torch.Tensor | None = None) -> torch.Tensor:
        """log π [b, k, V] at columns ``cols`` (no gradient), in ``logits_dtype`` of the head's output (``lsm``, the
        learner's log-softmax there, is not needed)."""
        z = self.states[:, cols]
        if self.head is None:
            return _log_softmax(z, self.temperature)
        with autocast_state(z.device.type, self.autocast):
            z = self.head(z)
        z = z.to(logits_dtype(z.dtype))
        # the head's fresh output: divided in place (the same op as _log_softmax's), one [b, k, V] buffer less
        return torch.log_softmax(z if self.temperature == 1.0 else z.div_(self.temperature), dim=-1)


@dataclass(frozen=True)
class RecordedInput:
    """Rows whose distribution was recorded when they were sampled, in place of a ``HeadInput``: ``states`` [b, C, V]
    float32 log-softmax (right-aligned like the response mask; named as ``HeadInput``'s so that the row and column
    slicing is shared), ``rows`` long [b] or None as there. For an engine whose distribution teacher forcing does
    not rebuild (``rollout.spec.behaviour_distribution`` "recorded")."""

    states: torch.Tensor
    rows: torch.Tensor | None = None
    per_position = ("states",)

    def log_probs(self, cols: slice, lsm: torch.Tensor | None = None) -> torch.Tensor:
        """The recorded log π [b, k, V] at columns ``cols``: a copy (the caller writes over it; ``lsm`` not needed)."""
        return self.states[:, cols].clone()


@dataclass(frozen=True)
class TopKInput:
    """Rows whose engine returned only its top-k log-probs (``rollout.spec.behaviour_distribution`` "top_k"), in place
    of a ``HeadInput``: ``states`` [b, C, k] float32 log π_b of the tokens ``ids`` [b, C, k] long at each position
    (right-aligned like the response mask), ``rows`` as there. Its log π_ref at a chunk is
    ``objectives.kl.top_k_reference`` of those and the learner's own log-softmax there: π_b on the k tokens, its
    remaining mass spread like π_θ over the others, so the chunk's exact KL is ``top_k_kl_lower_bound`` (a lower
    bound on KL(π_θ‖π_b)) and its written-out gradient that bound's."""

    states: torch.Tensor
    ids: torch.Tensor
    rows: torch.Tensor | None = None
    per_position = ("states", "ids")

    @torch.no_grad()
    def log_probs(self, cols: slice, lsm: torch.Tensor | None = None) -> torch.Tensor:
        """log r [b, k, V] at columns ``cols`` from ``lsm`` [b, k, V], the learner's log-softmax at these rows and
        columns (a new tensor). Raises ValueError without ``lsm``."""
        if lsm is None:
            raise ValueError("a top-k behaviour's reference is built from the learner's log-softmax; pass lsm")
        return top_k_reference(lsm, self.states[:, cols], self.ids[:, cols])


def _take(part, index, **changes):
    """``part`` with ``index`` (a function of a [b, C, ...] tensor) applied to each of its per-position tensors."""
    return replace(part, **{n: index(getattr(part, n)) for n in part.per_position}, **changes)


@dataclass(frozen=True)
class TeacherForced:
    """A distribution over B rows that is never stored as ``[B, C, V]``: ``HeadInput`` parts (one per model that
    sampled some of the rows), whose log-softmax is computed for the columns asked and freed by the caller, and
    ``RecordedInput`` parts (rows whose distribution was recorded at sampling: read, not computed) and ``TopKInput``
    parts (rows whose engine returned its top-k log-probs: a reference built per chunk from the learner's own).

    Raises ValueError (constructor): no part, or a part for every row (``rows`` None) beside others.
    """

    parts: tuple[HeadInput | RecordedInput | TopKInput, ...]
    n_rows: int

    def __post_init__(self):
        if not self.parts or (len(self.parts) > 1 and any(p.rows is None for p in self.parts)):
            raise ValueError("TeacherForced takes one part for every row, or parts with their rows")

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.parts[0].states.shape[1]

    def columns(self, start: int) -> "TeacherForced":
        return replace(self, parts=tuple(_take(p, lambda t: t[:, start:]) for p in self.parts))

    def row_block(self, block: slice) -> "TeacherForced":
        """The rows ``block`` (a step-1 slice, as ``chunk_plan``'s row blocks) renumbered from 0: each part keeps its
        states at those rows; a part with none of them is dropped (its rows read 0, as rows no part covers)."""
        start, stop, _ = block.indices(self.n_rows)
        parts = []
        for p in self.parts:
            if p.rows is None:
                parts.append(_take(p, lambda t: t[start:stop]))
                continue
            keep = ((p.rows >= start) & (p.rows < stop)).nonzero().squeeze(-1)
            if keep.numel():
                parts.append(_take(p, lambda t: t[keep], rows=p.rows[keep] - start))
        if not parts:  # no model sampled these rows (e.g. every one is padding): one empty part reads 0 everywhere
            p = self.parts[0]
            parts = [_take(p, lambda t: t[:0], rows=p.rows[:0] if p.rows is not None else
                           torch.zeros(0, dtype=torch.long, device=p.states.device))]
        return TeacherForced(tuple(parts), stop - start)

    @property
    def top_k(self) -> bool:
        """Whether some rows' reference is built from their engine's top-k log-probs (``TopKInput``)."""
        return any(isinstance(p, TopKInput) for p in self.parts)

    def at(self, mask: torch.Tensor) -> "Positions":
        """This distribution at the positions where ``mask`` [B, C] bool is true, in row-major order, laid out as one
        row ``[1, M]`` (M = mask.sum(): the packed learner's layout, ``policy.packed``). Each part keeps its states
        at its rows' true positions; its rows become those positions' indices."""
        flat = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        n = int(mask.sum())
        flat[mask] = torch.arange(n, device=mask.device)
        parts = []
        for p in self.parts:
            m = mask if p.rows is None else mask[p.rows]
            parts.append(_take(p, lambda t: t[m][:, None], rows=None if p.rows is None else flat[p.rows][m]))
        return Positions(TeacherForced(tuple(parts), n))

    def log_probs(self, cols: slice, dtype: torch.dtype, lsm: torch.Tensor | None = None) -> torch.Tensor:
        """log π [B, k, V] in ``dtype`` at columns ``cols`` (0 at rows no part covers). ``lsm`` [B, k, V]: the
        learner's log-softmax at those columns, which ``TopKInput`` parts need (ValueError without it)."""
        out = None
        for p in self.parts:
            own = None if lsm is None else lsm if p.rows is None else lsm[p.rows]
            part = p.log_probs(cols, own).to(dtype)
            if p.rows is None:
                return part
            if out is None:
                out = part.new_zeros((self.n_rows, *part.shape[1:]))
            out.index_copy_(0, p.rows, part)
            del part
        return out


@dataclass(frozen=True)
class Positions:
    """A ``TeacherForced`` read at M positions laid out as one row ``[1, M]`` (``TeacherForced.at``), in its place in a
    ``KLReference``. ``inner`` holds the positions as M rows of one column, so that a chunk of the row's columns
    is a block of ``inner``'s rows, read with the same code."""

    inner: TeacherForced

    @property
    def shape(self) -> tuple[int, int]:
        return 1, self.inner.n_rows

    @property
    def top_k(self) -> bool:
        return self.inner.top_k

    def columns(self, start: int) -> "Positions":
        return Positions(self.inner.row_block(slice(start, None)))

    def row_block(self, block: slice) -> "Positions":
        """The one row (``block`` must cover it: ValueError otherwise)."""
        if block.indices(1)[:2] != (0, 1):
            raise ValueError("Positions is one row; its row block is the whole of it")
        return self

    def log_probs(self, cols: slice, dtype: torch.dtype, lsm: torch.Tensor | None = None) -> torch.Tensor:
        """log π [1, k, V] in ``dtype`` at columns ``cols`` (a step-1 slice), as ``TeacherForced.log_probs``."""
        own = None if lsm is None else lsm.transpose(0, 1)
        return self.inner.row_block(cols).log_probs(slice(None), dtype, own).transpose(0, 1)


def _narrow(t, start: int):
    return t[:, start:] if isinstance(t, torch.Tensor) else t.columns(start)


def _row_block(t, block: slice):
    return t[block] if isinstance(t, torch.Tensor) else t.row_block(block)


def _read(t, cols: slice, dtype: torch.dtype, lsm: torch.Tensor | None) -> torch.Tensor:
    return t[:, cols].to(dtype) if isinstance(t, torch.Tensor) else t.log_probs(cols, dtype, lsm)


@dataclass(frozen=True)
class KLReference:
    """The distribution π_ref of an exact KL(π_θ ‖ π_ref) at each response position.

    ``logprobs`` holds one or two distributions (no gradient), right-aligned like the response mask: each a
    ``[B, C, V]`` log-softmax tensor or a ``TeacherForced`` (recomputed per chunk, never stored whole). One: log π_ref
    is that distribution. Two: the mixture
    log π_ref(v) = logaddexp(log_weights[0] + logprobs[0](v), log_weights[1] + logprobs[1](v)) − log_norm
    (P3O's two-anchor π_mix, ``objectives.p3o.anchor_log_weights``). ``mask`` [B, C] bool: the KL is 0,
    with no gradient, outside it (both distributions are zeroed there first, as ``objectives.p3o`` does).

    A ``TeacherForced`` with ``TopKInput`` parts makes the KL at those rows the top-k lower bound; it is taken alone:
    a mixture with it (ValueError) would be neither a bound on KL(π_θ‖π_mix) nor differentiated right (the
    reference's tail follows π_θ, which the mixture no longer cancels).
    """

    logprobs: tuple
    mask: torch.Tensor
    log_weights: tuple = ()
    log_norm: torch.Tensor | float = 0.0

    def __post_init__(self):
        if len(self.logprobs) not in (1, 2) or (len(self.logprobs) == 2 and len(self.log_weights) != 2):
            raise ValueError("KLReference takes one log-prob distribution, or two with two log_weights")
        if len(self.logprobs) == 2 and any(isinstance(t, TeacherForced) and t.top_k for t in self.logprobs):
            raise ValueError("KLReference takes a top-k behaviour alone, not in a mixture")
        B, C = self.mask.shape
        for t in self.logprobs:
            if tuple(t.shape[:2]) != (B, C) or (isinstance(t, torch.Tensor) and t.dim() != 3):
                raise ValueError(f"KLReference log-probs have shape {tuple(t.shape)}; want [{B}, {C}, V]")

    def columns(self, start: int) -> "KLReference":
        """The reference for response columns ``start:`` (as ``forward.trim`` narrows a micro-batch)."""
        return replace(self, logprobs=tuple(_narrow(t, start) for t in self.logprobs), mask=self.mask[:, start:])

    def rows(self, block: slice) -> "KLReference":
        """The reference for the rows ``block`` (a step-1 slice: ``chunked_logprobs``'s row blocks)."""
        # log_weights and log_norm are 0-dim (``objectives.p3o.anchor_log_weights``): shared by every row
        return replace(self, logprobs=tuple(_row_block(t, block) for t in self.logprobs), mask=self.mask[block])

    def log_probs(self, cols: slice, dtype: torch.dtype,
                  lsm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [B, k, 1], log π_ref [B, k, V] in ``dtype``, zero outside the mask) at columns ``cols``: a new
        tensor the caller may overwrite. ``lsm`` [B, k, V], the learner's log-softmax there (no gradient), is
        needed where some rows' engine returned top-k log-probs (``TopKInput``)."""
        m3 = self.mask[:, cols, None]
        zero = torch.zeros((), dtype=dtype)
        # a stored tensor's chunk may be a view of it: zeroed out of place; a recomputed one in place
        parts = [torch.where(m3, _read(t, cols, dtype, lsm), zero) if isinstance(t, torch.Tensor)
                 else _read(t, cols, dtype, lsm).masked_fill_(~m3, 0.0) for t in self.logprobs]
        if len(parts) == 1:
            return m3, parts[0]
        lw0, lw1 = self.log_weights
        a, b = parts[0].add_(lw0), parts[1].add_(lw1)  # fresh tensors: in place, one [B, k, V] less each step
        del parts
        return m3, torch.logaddexp(a, b, out=a).sub_(self.log_norm)


def reference_kl(lsm: torch.Tensor, ref: KLReference, cols: slice = slice(None)) -> torch.Tensor:
    """``exact_kl`` ``[B, k]`` of the log-softmax ``lsm`` [B, k, V] against ``ref`` at its columns ``cols``, both
    zeroed outside the mask first (``objectives.p3o``'s own ops), and 0 there. Differentiable (the full path)."""
    m3, mix = ref.log_probs(cols, lsm.dtype, lsm.detach())
    zero = torch.zeros((), dtype=lsm.dtype)
    return torch.where(m3[..., 0], exact_kl(torch.where(m3, lsm, zero), mix), zero)


def _difference(lsm: torch.Tensor, ref: KLReference, cols: slice):
    """(mask [B, k, 1], d = lsm − log π_ref written over π_ref's fresh buffer, p = exp(lsm)), d 0 where p is
    (0·log 0 = 0, as ``exact_kl``): two [B, k, V] buffers beside ``lsm``."""
    m3, d = ref.log_probs(cols, lsm.dtype, lsm)
    d.neg_().add_(lsm)  # a + (−b) is a − b exactly
    p = lsm.exp()
    d.masked_fill_(p == 0, 0.0)
    return m3, d, p


def _chunk_kl(lsm: torch.Tensor, ref: KLReference, cols: slice) -> torch.Tensor:
    """``reference_kl``'s value, bit for bit, without gradient and with two [B, k, V] buffers beside ``lsm``
    (the product written over the probabilities)."""
    m3, d, p = _difference(lsm, ref, cols)
    return torch.where(m3[..., 0], p.mul_(d).sum(-1), torch.zeros((), dtype=lsm.dtype))


def _head(h: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The chunk's logits in the head's dtype (the model's, or autocast's)."""
    return F.linear(h, weight, bias)


def _spans(C: int, chunk: int) -> list[slice]:
    return [slice(s, min(C, s + chunk)) for s in range(0, C, chunk)]


def chunk_plan(B: int, C: int, chunk_tokens: int) -> tuple[int, int]:
    """(rows, columns) of one chunk of at most ``chunk_tokens`` positions of a ``[B, C]`` micro-batch: every row
    and ⌊chunk_tokens / B⌋ columns when B ≤ chunk_tokens, else blocks of ``chunk_tokens`` rows, one column
    at a time. rows · columns ≤ chunk_tokens. Raises ValueError for chunk_tokens < 1."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_tokens}")
    rows = max(1, min(B, chunk_tokens))
    return rows, max(1, min(C, chunk_tokens // rows))


def token_spans(B: int, C: int, chunk_tokens: int) -> list[tuple[slice, slice]]:
    """The (rows, columns) slices of ``chunk_plan``'s chunks, row block by row block, tiling [B, C] once."""
    rows, cols = chunk_plan(B, C, chunk_tokens)
    return [(r, c) for r in _spans(B, rows) for c in _spans(C, cols)]


def fits_one_chunk(B: int, C: int, chunk_tokens: int | None) -> bool:
    """Whether the full path's ``[B, C + 1, V]`` logits fit in one chunk (or chunking is off: None)."""
    return chunk_tokens is None or B * (C + 1) <= chunk_tokens


def _log_softmax(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax((z upcast to float32) / T): the full path's ops, in its order."""
    z = z.to(logits_dtype(z.dtype))
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1)


class _ChunkedHead(torch.autograd.Function):
    """(logp, entropy, kl) of ``chunked_logprobs``; saves hidden, weight, bias, targets; recomputes logits in backward
    (``direct``, a frozen head's log-probs alone: saves ``_logp_slope`` instead and recomputes nothing).

    The backward recomputes each chunk's head output and takes its gradient with the full path's
    backward ops (upcast, /T, log-softmax, gather) or, with the KL, the same gradient written out
    (``_kl_chunk_grad``, π_ref recomputed for the chunk), adds the entropy's (``_entropy_chunk_grad``) when it
    carries gradient, then multiplies through the head by hand, summing the weight's gradient over chunks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, ref, entropy_grad, direct):
        B, C, _ = hidden.shape
        logp = ent = kl = slope = None
        for cols in _spans(C, chunk):
            z = _head(hidden[:, cols], weight, bias)
            head_dtype, lsm = z.dtype, _log_softmax(z, temperature)
            del z
            if logp is None:
                logp = lsm.new_empty((B, C))
                ent = lsm.new_empty((B, C) if with_entropy else (0,))
                kl = lsm.new_empty((B, C) if ref is not None else (0,))
                slope = lsm.new_empty((B, C, hidden.shape[-1]) if direct else (0,))
            logp[:, cols] = lsm.gather(-1, targets[:, cols, None]).squeeze(-1)
            if ref is not None:
                kl[:, cols] = _chunk_kl(lsm, ref, cols)
            p = lsm.exp() if with_entropy or direct else None
            if direct:
                slope[:, cols] = _logp_slope(p, weight, targets[:, cols], head_dtype, temperature)
            if with_entropy:  # the full path's −(exp(lsm)·lsm).sum(−1), its product written over exp(lsm)
                ent[:, cols] = -(p.mul_(lsm)).sum(-1)
            del lsm, p
        ctx.direct, ctx.hidden_dtype = direct, hidden.dtype
        if direct:  # the backward is g·slope: no hidden states, weight or logits kept for it
            ctx.save_for_backward(slope)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.ref = temperature, chunk, ref
        ctx.kl = kl.detach() if ref is not None else None  # [B, C]: the backward's KL_t (detached: no reference cycle)
        ctx.ent = ent.detach() if entropy_grad and with_entropy else None  # [B, C]: the backward's H_t
        dev = hidden.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        constant = [t for t, c in ((ent, ctx.ent is None), (kl, ref is None)) if c]
        if constant:
            ctx.mark_non_differentiable(*constant)  # one call: a second replaces it
        return logp, ent, kl

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_kl):
        if ctx.direct:
            g_hidden = None if g_logp is None else (g_logp[..., None] * ctx.saved_tensors[0]).to(ctx.hidden_dtype)
            return g_hidden, None, None, None, None, None, None, None, None, None
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_hidden = torch.zeros_like(hidden) if need_h else None
        g_weight = torch.zeros_like(weight) if need_w else None
        g_bias = torch.zeros_like(bias) if need_b else None
        dev, enabled, ac_dtype = ctx.autocast
        with_kl = g_kl is not None and ctx.ref is not None
        with_ent = g_ent is not None and ctx.ent is not None
        if g_logp is None and not with_kl and not with_ent:
            return None, None, None, None, None, None, None, None, None, None
        for cols in _spans(hidden.shape[1], ctx.chunk):
            h = hidden[:, cols]
            with torch.no_grad(), torch.autocast(dev, dtype=ac_dtype, enabled=enabled):  # the forward's head
                z = _head(h, weight, bias)
            head_dtype, lsm = z.dtype, _log_softmax(z, ctx.temperature)
            del z  # before the gradient's buffers
            g = None if g_logp is None else g_logp[:, cols, None]
            if with_kl:
                grad = _kl_chunk_grad(lsm, ctx.ref, cols, ctx.kl[:, cols], targets[:, cols, None], g,
                                      g_kl[:, cols, None])
            elif g is not None:
                grad = _logp_chunk_grad(lsm, targets[:, cols, None], g)
            else:
                grad = None
            if with_ent:
                grad = _entropy_chunk_grad(grad, lsm, ctx.ent[:, cols], g_ent[:, cols, None])
            del lsm
            if ctx.temperature != 1.0:
                grad = grad / ctx.temperature
            grad = grad.to(head_dtype).reshape(-1, weight.shape[0])  # [B·k, V] in the head's dtype
            if need_h:
                g_hidden[:, cols] = (grad @ weight.to(grad.dtype)).view(*h.shape[:2], -1).to(hidden.dtype)
            if need_w:
                h2 = h.reshape(-1, h.shape[-1]).to(grad.dtype)
                if g_weight.dtype == grad.dtype:
                    g_weight.addmm_(grad.t(), h2)
                else:
                    g_weight.add_((grad.t() @ h2).to(g_weight.dtype))
            if need_b:
                g_bias.add_(grad.sum(0).to(g_bias.dtype))
            del grad
        return g_hidden, g_weight, g_bias, None, None, None, None, None, None, None


def _direct(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, more_than_logp: bool) -> bool:
    """Whether the chunked head forms the hidden states' gradient in its forward (``_logp_slope``): a frozen head
    (LoRA) needs only that gradient, and for the log-probs alone (``more_than_logp`` False) it is g·slope."""
    return (torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
            and (bias is None or not bias.requires_grad) and not more_than_logp)


def _logp_slope(p: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, head_dtype: torch.dtype,
                temperature: float) -> torch.Tensor:
    """∂ log p(target)/∂h = (W[target] − Σ_v p_v·W_v) / T  [B, k, H] in ``p``'s dtype, for a head whose weight and
    bias take no gradient: the softmax Jacobian (∂ log p_y/∂s_u = 1[u = y] − p_u, s = z/T) through z = W·h + b.
    ``p`` [B, k, V] the chunk's probabilities, ``targets`` [B, k]. The expectation is one product in the head's
    dtype, as the full path's backward multiplies its logit gradient through the head (autocast off: explicit)."""
    with torch.autocast(p.device.type, enabled=False):
        expected = p.to(head_dtype) @ weight.to(head_dtype)
    slope = weight[targets].to(p.dtype).sub_(expected.to(p.dtype))
    return slope if temperature == 1.0 else slope.div_(temperature)


def _logp_chunk_grad(lsm: torch.Tensor, targets: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. s = z↑/T of Σ g·lsm[target], lsm = log-softmax(s): autograd's own backward ops (gather:
    zeros + scatter_add; log-softmax: ``_log_softmax_backward_data``), each [B, k, V] buffer freed as soon as it is
    used (three alive at most, with the caller's ``lsm``, which it frees before the head's matmuls). The caller
    applies the rest of the full path's backward (/T, then the cast to the head's dtype)."""
    g_lsm = torch.zeros_like(lsm).scatter_add_(-1, targets, g.to(lsm.dtype))
    grad = torch._log_softmax_backward_data(g_lsm, lsm, -1, lsm.dtype)
    del g_lsm
    return grad


def _kl_chunk_grad(lsm: torch.Tensor, ref: KLReference, cols: slice, kl: torch.Tensor, targets: torch.Tensor,
                   g_logp: torch.Tensor | None, g_kl: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. s = z↑/T of Σ g_logp·log p(target) + g_kl·KL, written out (no autograd graph, three
    [B, k, V] buffers with ``lsm``): with p = softmax(s), d = log p − log π_ref and KL = Σ_v p_v·d_v,

        ∂/∂s_u = g_logp·(1[u = target] − p_u) + g_kl·p_u·(d_u − KL)      (0 for the KL outside the mask)

    the softmax Jacobian of ``objectives.kl.exact_kl``'s docstring; the caller then divides by T and casts.
    ``kl`` [B, k] is the forward's value; ``g_logp`` [B, k, 1] or None, ``g_kl`` [B, k, 1]."""
    m3, d, p = _difference(lsm, ref, cols)
    zero = torch.zeros((), dtype=lsm.dtype)
    d.sub_(kl[..., None].to(lsm.dtype)).mul_(torch.where(m3, g_kl.to(lsm.dtype), zero))
    if g_logp is not None:
        d.sub_(g_logp.to(lsm.dtype))
    grad = d.mul_(p)
    del p
    if g_logp is not None:
        grad.scatter_add_(-1, targets, g_logp.to(lsm.dtype))
    return grad


def _entropy_chunk_grad(grad: torch.Tensor | None, lsm: torch.Tensor, ent: torch.Tensor,
                        g_ent: torch.Tensor) -> torch.Tensor:
    """``grad`` (w.r.t. s = z↑/T, or None: 0) plus that of Σ g_ent·H, H = −Σ_v p_v log p_v, p = softmax(s):

        ∂H/∂s_u = −p_u·(log p_u + H)

    (the softmax Jacobian applied to ∂H/∂log p_v = −p_v·(1 + log p_v), whose p-weighted sum is H − 1). ``ent`` [B, k]
    is the forward's H; ``g_ent`` [B, k, 1]. Two [B, k, V] buffers beside ``lsm`` and ``grad`` (one left)."""
    term = lsm + ent[..., None].to(lsm.dtype)
    term.mul_(lsm.exp()).mul_(g_ent.to(lsm.dtype).neg())
    return term if grad is None else grad.add_(term)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, *,
                     chunk_size: int, temperature: float = 1.0, with_entropy: bool = False,
                     kl_reference: KLReference | None = None, entropy_grad: bool = False):
    """Log-probs, entropy and exact KL of ``softmax((hidden · weightᵀ + bias) / T)`` at each position, chunk by chunk.

    Args:
        hidden: ``[B, C, H]`` final hidden states at the positions that predict ``targets`` (or ``[N, H]``,
            taken as one row), any float dtype; gradient flows to it.
        weight: ``[V, H]`` LM-head weight (tied or not); gradient flows to it, summed over chunks.
        bias: ``[V]`` or None.
        targets: ``[B, C]`` (or ``[N]``) long, the sampled tokens.
        chunk_size: tokens (rows × columns) per chunk (``chunk_plan``): at most chunk_size·V logits
            are alive at a time, in the forward and in the backward.
        temperature: divides the logits (to score a policy at T ≠ 1).
        with_entropy: also return the entropy −Σ_v p log p in nats (no gradient unless ``entropy_grad``).
        entropy_grad: with ``with_entropy``, the entropy carries gradient (an entropy bonus in the loss): the
            backward adds ∂H/∂s_u = −p_u·(log p_u + H) per chunk (``_entropy_chunk_grad``). False: the same ops as
            without entropy in the backward, bit for bit.
        kl_reference: also return the exact KL(π_θ ‖ π_ref) per position in nats, with gradient
            (``objectives.kl.exact_kl``'s formula; 0 outside ``kl_reference.mask``).

    A frozen head (``weight`` and ``bias`` without gradient, under grad mode, no KL, no entropy gradient) takes the
    hidden states' gradient from the forward (``_logp_slope``): its backward recomputes no logits.

    Returns:
        (logp, entropy, kl): ``[B, C]`` (or ``[N]``) in the logits' dtype upcast to at least float32;
        entropy and kl are None when not asked for. The same values as log_softmax of the full
        logits up to float round-off; gradients likewise (the weight's is summed chunk by chunk).

    Raises:
        ValueError: a chunk_size below 1, or shapes that do not match.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = hidden.dim() == 2
    if flat:
        hidden, targets = hidden[None], targets[None]
    if hidden.dim() != 3 or tuple(targets.shape) != tuple(hidden.shape[:2]) or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, targets {tuple(targets.shape)} and weight {tuple(weight.shape)} "
                         "do not match: want [B, C, H], [B, C] and [V, H]")
    if kl_reference is not None and tuple(kl_reference.mask.shape) != tuple(targets.shape):
        raise ValueError(f"kl_reference covers {tuple(kl_reference.mask.shape)} positions, targets {tuple(targets.shape)}")
    B, C = targets.shape
    rows, cols = chunk_plan(B, C, int(chunk_size))
    direct = _direct(hidden, weight, bias, kl_reference is not None or (with_entropy and entropy_grad))
    blocks = []  # one Function per block of rows; autograd sums the weight's gradient over blocks
    for r in _spans(B, rows):
        ref = kl_reference if rows == B or kl_reference is None else kl_reference.rows(r)
        blocks.append(_ChunkedHead.apply(hidden[r], weight, bias, targets[r], float(temperature), cols,
                                         bool(with_entropy), ref, bool(entropy_grad), direct))
    logp, ent, kl = blocks[0] if len(blocks) == 1 else (torch.cat(ts) for ts in zip(*blocks))
    out = (logp, ent if with_entropy else None, kl if kl_reference is not None else None)
    return tuple(None if t is None else (t[0] if flat else t) for t in out)


@torch.no_grad()
def chunked_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, chunk_size: int,
                        temperature: float = 1.0) -> torch.Tensor:
    """The whole log-softmax ``[B, C, V]`` (no gradient), computed chunk by chunk (``token_spans``): the stored
    output is the only [B, C, V] tensor alive (e.g. the proximal snapshot of ``kl="exact"``). Shapes as
    ``chunked_logprobs``."""
    out = None
    for rows, cols in token_spans(hidden.shape[0], hidden.shape[1], chunk_size):
        lsm = _log_softmax(_head(hidden[rows, cols], weight, bias), temperature)
        if out is None:
            out = lsm.new_empty((hidden.shape[0], hidden.shape[1], lsm.shape[-1]))
        out[rows, cols] = lsm
    return out


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False,
                  temperature: float = 1.0, with_full: bool = False, kl_reference: KLReference | None = None,
                  entropy_grad: bool = False):
    """The full path: log-probs from whole ``[B, C, V]`` logits (``forward.response_logprobs`` for one chunk).

    Returns (logp [B, C], entropy [B, C] or None), then the log-softmax [B, C, V] if ``with_full``, then
    the exact KL [B, C] if ``kl_reference``; dtypes and formulas as ``chunked_logprobs`` (the entropy through
    autograd when ``entropy_grad``, else without gradient).
    """
    logits = logits.to(logits_dtype(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    ent = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    out = (logp, ent)
    if with_full:
        out += (logp_all,)
    if kl_reference is not None:
        out += (reference_kl(logp_all, kl_reference),)
    return out


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *, chunk_size: int,
                  with_entropy: bool = False, temperature: float = 1.0, with_full: bool = False,
                  kl_reference: KLReference | None = None, entropy_grad: bool = False):
    """``full_logprobs``'s outputs from the hidden states ``[B, C, H]`` and the LM head, chunk by chunk.

    ``with_full`` (no gradient: ``chunked_log_softmax``) builds the [B, C, V] log-softmax one chunk at a
    time; otherwise ``chunked_logprobs`` (``entropy_grad`` as there). The head's ``weight`` Parameter itself enters the autograd
    graph (no copy), so tied embeddings, DDP's and FSDP2's gradient hooks see its gradient.
    """
    if with_full:
        full = chunked_log_softmax(hidden, head.weight, head.bias, chunk_size=chunk_size, temperature=temperature)
        logp = full.gather(-1, targets[..., None]).squeeze(-1)
        ent = None
        if with_entropy:
            ent = full.new_empty(full.shape[:2])
            for rows, cols in token_spans(full.shape[0], full.shape[1], chunk_size):
                f = full[rows, cols]
                ent[rows, cols] = -(f.exp() * f).sum(-1)
        return logp, ent, full
    logp, ent, kl = chunked_logprobs(hidden, head.weight, head.bias, targets, chunk_size=chunk_size,
                                     temperature=temperature, with_entropy=with_entropy, kl_reference=kl_reference,
                                     entropy_grad=entropy_grad)
    return (logp, ent) if kl_reference is None else (logp, ent, kl)
