"""Padding-free (packed) learner forwards: a micro-batch's real tokens in rows, no padding computed.

``forward.pack`` left-pads every ``prompt + completion`` to the micro-batch's longest, so a batch of
mixed completion lengths spends decoder work on padding. ``packed_response_logprobs`` drops it: the
attended tokens of every row are laid end to end, their ``position_ids`` restarting at 0 for each
sequence, in rows ``[R, W]`` no longer than the longest sequence (first-fit decreasing; sdpa and eager
attend through a dense mask, so one long row would cost its length squared). Attention must not cross
sequences:

- plain packing: no attention mask, only the restarting ``position_ids``. This is transformers'
  own padding-free path (TRL's ``padding_free``, ``DataCollatorWithFlattening``):
  ``masking_utils.find_packed_sequence_indices`` turns the restarts into a block-diagonal causal mask
  for sdpa, eager and flex attention, and flash-attention takes them as ``cu_seqlens`` (varlen).
- shared prompts (``share_prompts``): each distinct prompt once, followed in its row by every completion
  segment that reads it (last prompt token + completion, ``shared_prompt.split_prompts``), with a 4-D
  mask in which a segment sees its own prompt and its own earlier tokens: the prefix-tree mask. Only the
  sdpa and eager implementations take an arbitrary 4-D mask, and every layer reads it as given, so a model
  with sliding-window or chunked attention layers packs plainly too.

A model whose attention would cross packed sequences even so (ALiBi biases computed from the attention mask,
OPT's mask built without positions: ``packing_unsupported``) takes the padded forward, with one warning.

The LM head runs only on the Σ n_i positions that predict a completion token (the full head, or
``chunked_logprobs``, on those hidden states), and the results are spread back to the ``[B, C]``
right-aligned layout of ``forward.response_logprobs``: a drop-in replacement for it and for
``grouped_response_logprobs``, with the same values up to float summation order
(``tests/unit/test_packed.py``: float64, 1e-10).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from .chunked_logprobs import HeadInput, KLReference, TeacherForced, full_logprobs, head_logprobs
from .forward import (Packed, Teacher, decoder_hidden, head_parts, last_hidden, response_logprobs, teacher_forced,
                      teaching, unwrap)
from .shared_prompt import recurrent, shared_prompt_unsupported, split_prompts, uses_alibi

_TREE_MASK_ATTN = ("sdpa", "eager")  # attention implementations that take an arbitrary 4-D mask as given
# model types whose causal mask ignores restarting position_ids (OPT and BioGPT build it from the attention mask
# alone), so packed sequences would see each other; tests/unit/test_packed_models.py finds them by a sweep of types
_MASK_WITHOUT_POSITIONS = ("opt", "biogpt")
_WARNED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
log = logging.getLogger(__name__)


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why packed sequences would attend to each other in ``model`` (unwrapped), or None: ALiBi biases, computed from
    the attention mask, a causal mask built without ``position_ids``, or a recurrent state (Mamba, Jamba, Falcon-H1,
    OLMo-hybrid: transformers' ``_is_stateful``), which runs on from one packed sequence into the next. Such a
    model takes the padded forward."""
    if recurrent(model):
        return "a recurrent state would run on from one packed sequence into the next"
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if uses_alibi(text):
        return "ALiBi position biases are computed from the attention mask"
    if getattr(text, "model_type", "") in _MASK_WITHOUT_POSITIONS:
        return f"{text.model_type}'s causal mask ignores position_ids"
    return None


@dataclass
class _Tokens:
    """A micro-batch's tokens in packing order ``[N]``: id, position, the item (sequence, or prompt with its
    segments) each belongs to, and for the prefix-tree mask its block (prompt or segment) and the prompt it
    reads; for each valid response position (``response_mask``, row-major) the index of the token predicting it."""

    ids: torch.Tensor
    pos: torch.Tensor
    item: torch.Tensor
    predictor: torch.Tensor
    block: torch.Tensor | None = None
    parent: torch.Tensor | None = None
    n_prefix_blocks: int = 0


@dataclass
class _Rows:
    """The packed model input: ``[R, W]`` ids and positions, the ``[R, 1, W, W]`` mask or None (restarting
    positions only), and the flat ``[R·W]`` indices of the predicting tokens ``[M]`` and their targets ``[M]``."""

    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor | None
    predictor: torch.Tensor
    targets: torch.Tensor


def _plain(packed: Packed) -> _Tokens | None:
    """Every row's attended tokens end to end; None when the micro-batch is not ``pack``'s left-padded layout
    (positions 0..len-1 after the padding) or a response position has no token before it."""
    ids, att, pos, m = packed.input_ids, packed.attention_mask.bool(), packed.position_ids, packed.response_mask
    B, L = ids.shape
    C = m.shape[1]
    lens = att.sum(1)
    start = L - lens
    col = torch.arange(L, device=ids.device)[None]
    if not torch.equal(att, col >= start[:, None]) or not torch.equal(pos[att], (col - start[:, None]).expand(B, L)[att]):
        return None
    local = (L - C + torch.arange(C, device=ids.device))[None] - start[:, None]  # [B, C] index within the row
    if bool((local[m] < 1).any()):
        return None
    offset = lens.cumsum(0) - lens
    item = torch.arange(B, device=ids.device)[:, None].expand(B, L)[att]
    return _Tokens(ids[att], pos[att], item, (offset[:, None] + local - 1)[m])


def _tree(packed: Packed) -> _Tokens | None:
    """Distinct prompts once, then each row's completion segment (last prompt token + completion); an item is a
    prompt with the segments that read it. None when ``split_prompts`` finds no shared layout."""
    s = split_prompts(packed)
    if s is None:
        return None
    dev = s.seg_ids.device
    U, P = s.prefix_ids.shape
    B, C1 = s.seg_ids.shape
    C = C1 - 1
    in_prefix = torch.arange(P, device=dev)[None] < s.prefix_len[:, None]  # [U, P]
    in_seg = torch.arange(C1, device=dev)[None] <= s.n[:, None]
    k = torch.arange(C, device=dev)[None] - (C - s.n)[:, None]  # [B, C] completion token index, < 0 before it
    m = packed.response_mask
    if bool((k[m] < 0).any()):
        return None
    n_pre = int(in_prefix.sum())
    prefix_of = torch.arange(U, device=dev)[:, None].expand(U, P)[in_prefix]
    seg_start = n_pre + (s.n + 1).cumsum(0) - (s.n + 1)
    return _Tokens(ids=torch.cat([s.prefix_ids[in_prefix], s.seg_ids[in_seg]]),
                   pos=torch.cat([torch.arange(P, device=dev).expand(U, P)[in_prefix], s.seg_pos[in_seg]]),
                   item=torch.cat([prefix_of, s.group[:, None].expand(B, C1)[in_seg]]),
                   predictor=(seg_start[:, None] + k)[m],
                   block=torch.cat([prefix_of, (U + torch.arange(B, device=dev))[:, None].expand(B, C1)[in_seg]]),
                   parent=torch.cat([prefix_of, s.group[:, None].expand(B, C1)[in_seg]]), n_prefix_blocks=U)


def _bins(sizes: list[int]) -> list[int]:
    """First-fit decreasing into rows as long as the longest item: each item's row. Attention over a packed row
    costs its length squared (sdpa and eager take a dense mask), so no row is longer than the padded layout's."""
    cap, fill, row = max(sizes), [], [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = next((r for r, f in enumerate(fill) if f + sizes[i] <= cap), len(fill))
        if r == len(fill):
            fill.append(0)
        row[i], fill[r] = r, fill[r] + sizes[i]
    return row


def _rows(t: _Tokens, mask_dtype: torch.dtype | None) -> _Rows:
    """Lay the items of ``t`` into rows (``_bins``), each item's tokens contiguous and in order. The tail of a
    row is filler: positions restarting at 0 (a sequence of its own), and under the tree mask a block of its own."""
    dev, N = t.ids.device, t.ids.shape[0]
    n_items = int(t.item.max()) + 1
    sizes = torch.bincount(t.item, minlength=n_items)
    row_of = torch.tensor(_bins(sizes.tolist()), device=dev)
    offset = torch.zeros(n_items, dtype=torch.long, device=dev)  # an item's first column in its row
    for r in range(int(row_of.max()) + 1):
        on = (row_of == r).nonzero().flatten()
        offset[on] = sizes[on].cumsum(0) - sizes[on]
    perm = torch.sort(t.item, stable=True).indices  # rank of each token within its item, in packing order
    first = sizes.cumsum(0) - sizes
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(N, device=dev) - first[t.item[perm]]
    r_tok, c_tok = row_of[t.item], offset[t.item] + rank
    R = int(row_of.max()) + 1
    W = int(sizes.max())
    used = torch.zeros(R, dtype=torch.long, device=dev).index_add_(0, row_of, sizes)
    col = torch.arange(W, device=dev)[None].expand(R, W)
    ids = torch.zeros(R, W, dtype=t.ids.dtype, device=dev)
    pos = (col - used[:, None]).clone()  # filler: 0, 1, ... after the row's last item
    ids[r_tok, c_tok], pos[r_tok, c_tok] = t.ids, t.pos
    flat = r_tok * W + c_tok
    predictor = flat[t.predictor]
    targets = t.ids[t.predictor + 1]
    if t.block is None:
        return _Rows(ids, pos, None, predictor, targets)
    block = (-1 - col).clone()  # filler: a block per token, seeing itself only
    parent = block.clone()
    block[r_tok, c_tok], parent[r_tok, c_tok] = t.block, t.parent
    is_prefix = (block >= 0) & (block < t.n_prefix_blocks)
    causal = col[:, None, :] <= col[:, :, None]  # [R, q, k]
    allowed = causal & ((block[:, None, :] == block[:, :, None])
                        | (is_prefix[:, None, :] & (block[:, None, :] == parent[:, :, None])))
    if mask_dtype is not None:  # eager adds the mask to its scores
        allowed = torch.zeros(allowed.shape, dtype=mask_dtype, device=dev).masked_fill_(~allowed, torch.finfo(mask_dtype).min)
    return _Rows(ids, pos, allowed[:, None], predictor, targets)


def _predicting_logits(model: torch.nn.Module, inputs: dict, rows: _Rows) -> torch.Tensor:
    """``[1, M, V]`` logits of the predicting tokens from the model's own forward, its head run only on the packed
    columns that hold one (``logits_to_keep`` as an index tensor, as transformers' heads take it): a head the chunked
    path cannot split (another post-head step, e.g. Gemma's soft-capping) computed ``[R, W, V]`` logits for every
    packed token, prompts included (2.9 GB against the padded path's 96 MiB for 600-token prompts at V = 151,936)."""
    W = rows.ids.shape[1]
    cols = torch.unique(rows.predictor % W)  # sorted
    logits = model(**inputs, logits_to_keep=cols).logits  # [R, K, V]
    at = (rows.predictor // W) * cols.numel() + torch.searchsorted(cols, rows.predictor % W)
    return logits.reshape(1, -1, logits.shape[-1])[:, at]


def _spread(t: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor | None:
    """``[1, M, ...]`` values of the valid response positions → ``[B, C, ...]`` (zeros elsewhere), differentiable."""
    if t is None:
        return None
    out = t.new_zeros(tuple(m.shape) + tuple(t.shape[2:]))
    out[m] = t[0]
    return out


def _layout(model: torch.nn.Module, packed: Packed, share_prompts: bool, min_saving: float) -> _Rows | None:
    """The packed rows ``model`` runs ``packed`` as: plain, or the prefix tree where ``model``'s attention takes
    the 4-D mask, every layer attends in full, and it saves ``min_saving`` of the tokens; None (the padded path) for
    a micro-batch without a valid response position or not in ``pack``'s layout, or a model that cannot pack
    (``packing_unsupported``)."""
    tokens = _plain(packed) if bool(packed.response_mask.any()) else None
    if tokens is None:
        return None
    inner = unwrap(model)
    reason = packing_unsupported(inner)
    if reason is not None:
        if inner not in _WARNED:
            _WARNED.add(inner)
            log.warning("padding-free forward off for %s: %s; using the padded forward", type(inner).__name__, reason)
        return None
    attn = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    # the tree's 4-D mask is taken as given by every layer: a sliding window or chunked layer would see the whole
    # prompt, so only models the shared-prompt forward accepts (full attention everywhere) get it
    if share_prompts and attn in _TREE_MASK_ATTN and shared_prompt_unsupported(inner, inference=True) is None:
        tree = _tree(packed)
        if tree is not None and tree.ids.shape[0] <= (1 - min_saving) * tokens.ids.shape[0]:
            tokens = tree
    return _rows(tokens, next(inner.parameters()).dtype if attn == "eager" else None)


def packed_response_logprobs(model: torch.nn.Module, packed: Packed, *, with_entropy: bool = False,
                             temperature: float = 1.0, with_full: bool = False, chunk_size: int | None = None,
                             kl_reference: KLReference | None = None, share_prompts: bool = True,
                             min_saving: float = 0.1, entropy_grad: bool = False):
    """``forward.response_logprobs`` (and with ``share_prompts``, ``grouped_response_logprobs``) without padding.

    Args:
        model: a transformers causal LM (or a DDP wrapper of one) whose attention reads packed
            ``position_ids`` (transformers ≥ 4.57: sdpa, eager, flex, flash-attention).
        packed: the micro-batch as ``forward.pack`` builds it (B rows, completion width C).
        share_prompts: each distinct prompt once with the prefix-tree mask, when the model's attention is
            sdpa or eager, the layout allows it, and it computes at least ``min_saving`` fewer tokens than
            plain packing; else plain packing.
        with_entropy, temperature, with_full, chunk_size, kl_reference, entropy_grad: as ``response_logprobs``. The
            chunked head (more predicted positions than chunk_size, which counts tokens) takes chunk_size packed
            positions per chunk, the same logits memory per chunk as the padded path.

    Returns:
        As ``response_logprobs``: (logp ``[B, C]``, entropy ``[B, C]`` or None), then the log-softmax
        ``[B, C, V]`` if ``with_full``, then the KL ``[B, C]`` if ``kl_reference``; 0 outside
        ``response_mask``. A micro-batch with no valid response position, or not in ``pack``'s layout,
        takes the padded ``response_logprobs``.

    Raises:
        ValueError: both ``with_full`` and ``kl_reference``.
    """
    if with_full and kl_reference is not None:
        raise ValueError("pass with_full or kl_reference, not both")
    m = packed.response_mask
    rows = _layout(model, packed, share_prompts, min_saving)
    kw = dict(with_entropy=with_entropy, temperature=temperature, with_full=with_full, entropy_grad=entropy_grad)
    if rows is None:
        return response_logprobs(model, packed, chunk_size=chunk_size, kl_reference=kl_reference, **kw)
    inputs = dict(input_ids=rows.ids, position_ids=rows.pos, attention_mask=rows.mask, use_cache=False)
    # the reference laid out as the predicted positions: a stored [B, C, V] by the mask, a rebuilt one by its parts
    ref = None if kl_reference is None else KLReference(
        tuple(t[m][None] if isinstance(t, torch.Tensor) else t.at(m) for t in kl_reference.logprobs),
        kl_reference.mask[m][None], kl_reference.log_weights, kl_reference.log_norm)
    kw["kl_reference"] = ref
    parts = head_parts(model)
    if parts is None:  # a head the chunked path cannot take: the model's own logits at the predicting columns
        out = full_logprobs(_predicting_logits(model, inputs, rows), rows.targets[None], **kw)
    else:
        decoder, head = parts
        _, hidden = decoder_hidden(model, decoder, **inputs)
        hidden = hidden.reshape(1, -1, hidden.shape[-1])[:, rows.predictor]
        # chunk_size counts tokens (policy.budget): the packed row holds every predicted position of the micro-batch
        if chunk_size is not None and hidden.shape[1] > chunk_size and not (with_full and torch.is_grad_enabled()):
            out = head_logprobs(hidden, head, rows.targets[None], chunk_size=chunk_size, **kw)
        else:
            out = full_logprobs(head(hidden), rows.targets[None], **kw)
    return tuple(_spread(t, m) for t in out)


@torch.no_grad()
def packed_teacher_forced(packed: Packed, teachers: Sequence[tuple[torch.Tensor | None, Teacher]], *,
                          share_prompts: bool = True, min_saving: float = 0.1) -> TeacherForced:
    """``forward.teacher_forced`` through the padding-free forward: each teacher runs its rows of ``packed`` packed
    (``_layout``: the rows, positions and mask ``packed_response_logprobs`` gives its own forward), without gradient,
    in eval mode under its autocast state, and keeps the decoder's hidden states at the predicting positions.

    Returns the same ``TeacherForced`` as ``teacher_forced`` (right-aligned ``[b, C, H]`` states per teacher, zero
    outside ``response_mask``), equal at every valid position up to float summation order; the padded learner and
    the packed one (``TeacherForced.at``) read it alike. A teacher whose rows have no packed layout is
    teacher-forced padded; one whose head ``head_parts`` cannot split keeps its logits at the predicting positions.
    """
    parts = []
    for rows, t in teachers:
        sub = packed if rows is None else packed.select(rows)
        layout = _layout(t.model, sub, share_prompts, min_saving)
        if layout is None:
            parts += teacher_forced(packed, [(rows, t)]).parts
            continue
        inputs = dict(input_ids=layout.ids, position_ids=layout.pos, attention_mask=layout.mask, use_cache=False)
        with teaching(t, layout.ids.device.type) as model:
            split = head_parts(model, linear=False)
            if split is None:
                states, head = _predicting_logits(model, inputs, layout), None
            else:
                decoder, head = split
                states = last_hidden(decoder(**inputs))
                states = states.reshape(1, -1, states.shape[-1])[:, layout.predictor]
        parts.append(HeadInput(_spread(states, sub.response_mask), head, rows, t.temperature, t.autocast))
    return TeacherForced(tuple(parts), packed.response_mask.shape[0])
