"""Padding-free (packed) learner forwards: a micro-batch's real tokens in one row, no padding computed.

``forward.pack`` left-pads every ``prompt + completion`` to the micro-batch's longest, so a batch of
mixed completion lengths spends decoder work on padding. ``packed_response_logprobs`` drops it: the
attended tokens of every row are laid end to end in one row ``[1, N]`` whose ``position_ids`` restart
at 0 for each sequence. Attention must not cross sequences:

- plain packing: no attention mask, only the restarting ``position_ids``. This is transformers'
  own padding-free path (TRL's ``padding_free``, ``DataCollatorWithFlattening``):
  ``masking_utils.find_packed_sequence_indices`` turns the restarts into a block-diagonal causal mask
  for sdpa, eager and flex attention, and flash-attention takes them as ``cu_seqlens`` (varlen).
- shared prompts (``share_prompts``): each distinct prompt once, then every row's completion segment
  (last prompt token + completion, ``shared_prompt.split_prompts``), with a 4-D mask in which a
  segment sees its own prompt and its own earlier tokens: the prefix-tree mask. Only the sdpa and
  eager implementations take an arbitrary 4-D mask; others pack plainly.

The LM head runs only on the Σ n_i positions that predict a completion token (``logits_to_keep`` as
indices, or ``chunked_logprobs`` on those hidden states), and the results are spread back to the
``[B, C]`` right-aligned layout of ``forward.response_logprobs``: a drop-in replacement for it and for
``grouped_response_logprobs``, with the same values up to float summation order
(``tests/unit/test_packed.py``: float64, 1e-10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunked_logprobs import KLReference, full_logprobs, head_logprobs
from .forward import Packed, decoder_hidden, head_parts, response_logprobs, unwrap
from .shared_prompt import split_prompts

_TREE_MASK_ATTN = ("sdpa", "eager")  # attention implementations that take an arbitrary 4-D mask as given


@dataclass
class _Row:
    """One packed row: ids and positions ``[N]``, the 4-D mask or None (plain packing), and for each valid
    response position (``response_mask``, row-major) the index of the token that predicts it ``[M]``."""

    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor | None
    predictor: torch.Tensor
    targets: torch.Tensor


def _plain(packed: Packed) -> _Row | None:
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
    flat = ids[att]
    predictor = (offset[:, None] + local - 1)[m]
    return _Row(flat, pos[att], None, predictor, flat[predictor + 1])


def _tree(packed: Packed, dtype: torch.dtype, attn: str) -> tuple[_Row, int] | None:
    """Distinct prompts once, then each row's completion segment, with the prefix-tree mask; None when
    ``split_prompts`` finds no shared layout. Also returns the tokens the tree row computes."""
    s = split_prompts(packed)
    if s is None:
        return None
    dev = s.seg_ids.device
    U, P = s.prefix_ids.shape
    B, C1 = s.seg_ids.shape
    C = C1 - 1
    in_prefix = torch.arange(P, device=dev)[None] < s.prefix_len[:, None]  # [U, P]
    in_seg = torch.arange(C1, device=dev)[None] <= s.n[:, None]  # last prompt token + n_i completion tokens
    ids = torch.cat([s.prefix_ids[in_prefix], s.seg_ids[in_seg]])
    pos = torch.cat([torch.arange(P, device=dev).expand(U, P)[in_prefix], s.seg_pos[in_seg]])
    # block: which prompt or segment a token belongs to; parent: the prompt it reads (its own for a prompt token)
    block = torch.cat([torch.arange(U, device=dev)[:, None].expand(U, P)[in_prefix],
                       (U + torch.arange(B, device=dev))[:, None].expand(B, C1)[in_seg]])
    parent = torch.cat([block[:int(in_prefix.sum())], s.group[:, None].expand(B, C1)[in_seg]])
    is_prefix = block < U
    N = ids.shape[0]
    order = torch.arange(N, device=dev)
    allowed = (order[None] <= order[:, None]) & ((block[None] == block[:, None])
                                                 | (is_prefix[None] & (block[None] == parent[:, None])))
    seg_start = int(in_prefix.sum()) + (s.n + 1).cumsum(0) - (s.n + 1)
    k = torch.arange(C, device=dev)[None] - (C - s.n)[:, None]  # [B, C] completion token index, < 0 before it
    m = packed.response_mask
    if bool((k[m] < 0).any()):
        return None
    predictor = (seg_start[:, None] + k)[m]
    mask = allowed if attn == "sdpa" else torch.zeros(N, N, dtype=dtype, device=dev).masked_fill_(
        ~allowed, torch.finfo(dtype).min)
    return _Row(ids, pos, mask[None, None], predictor, ids[predictor + 1]), N


def _spread(t: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor | None:
    """``[1, M, ...]`` values of the valid response positions → ``[B, C, ...]`` (zeros elsewhere), differentiable."""
    if t is None:
        return None
    out = t.new_zeros(tuple(m.shape) + tuple(t.shape[2:]))
    out[m] = t[0]
    return out


def packed_response_logprobs(model: torch.nn.Module, packed: Packed, *, with_entropy: bool = False,
                             temperature: float = 1.0, with_full: bool = False, chunk_size: int | None = None,
                             kl_reference: KLReference | None = None, share_prompts: bool = True,
                             min_saving: float = 0.1):
    """``forward.response_logprobs`` (and with ``share_prompts``, ``grouped_response_logprobs``) without padding.

    Args:
        model: a transformers causal LM (or a DDP wrapper of one) whose attention reads packed
            ``position_ids`` (transformers ≥ 4.57: sdpa, eager, flex, flash-attention).
        packed: the micro-batch as ``forward.pack`` builds it (B rows, completion width C).
        share_prompts: each distinct prompt once with the prefix-tree mask, when the model's attention is
            sdpa or eager, the layout allows it, and it computes at least ``min_saving`` fewer tokens than
            plain packing; else plain packing.
        with_entropy, temperature, with_full, chunk_size, kl_reference: as ``response_logprobs``. The
            chunked head (C > chunk_size) takes B·chunk_size packed positions per chunk, the same
            logits memory per chunk as the padded path.

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
    row = _plain(packed) if bool(m.any()) else None
    if row is None:
        return response_logprobs(model, packed, with_entropy=with_entropy, temperature=temperature,
                                 with_full=with_full, chunk_size=chunk_size, kl_reference=kl_reference)
    inner = unwrap(model)
    attn = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if share_prompts and attn in _TREE_MASK_ATTN:
        tree = _tree(packed, next(inner.parameters()).dtype, attn)
        if tree is not None and tree[1] <= (1 - min_saving) * row.ids.shape[0]:
            row = tree[0]
    B, C = m.shape
    inputs = dict(input_ids=row.ids[None], position_ids=row.pos[None], attention_mask=row.mask, use_cache=False)
    ref = None if kl_reference is None else KLReference(
        tuple(t[m][None] for t in kl_reference.logprobs), kl_reference.mask[m][None], kl_reference.log_weights,
        kl_reference.log_norm)
    parts = None
    if chunk_size is not None and C > chunk_size and not (with_full and torch.is_grad_enabled()):
        parts = head_parts(model)
    if parts is None:
        logits = model(**inputs, logits_to_keep=row.predictor).logits
        out = full_logprobs(logits, row.targets[None], with_entropy=with_entropy, temperature=temperature,
                            with_full=with_full, kl_reference=ref)
    else:
        decoder, head = parts
        _, hidden = decoder_hidden(model, decoder, **inputs)
        out = head_logprobs(hidden[:, row.predictor], head, row.targets[None], chunk_size=chunk_size * B,
                            with_entropy=with_entropy, temperature=temperature, with_full=with_full,
                            kl_reference=ref)
    return tuple(_spread(t, m) for t in out)
