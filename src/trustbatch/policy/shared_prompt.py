"""Shared-prompt learner forward: each distinct prompt runs once, its key/value cache serves all its completions.

A GRPO-style batch holds G completions per prompt; the plain forward (``forward.response_logprobs``)
runs ``prompt + completion`` for every row, so a prompt is computed G times. Here a micro-batch is
split into

* a **prompt pass** over the U distinct prompt prefixes (every prompt token but the last), with
  ``use_cache=True``; its key/value cache is part of the autograd graph, and
* a **completion pass** over ``[last prompt token] + completion`` for every row, attending to its
  prompt's cache rows (``index_select`` from U to B rows, so the prompt's activations receive the
  gradient of all its completions).

The result is exactly what ``response_logprobs`` returns (log-probs ``[B, C]`` right-aligned as in
``forward.pack``, and the entropy if asked) up to floating-point summation order; values at
positions outside ``response_mask`` differ (both are meaningless there and finite).

Groups are found by comparing prompt tokens inside the micro-batch, never from row order: the
learner shuffles rows into minibatches, and a micro-batch holding part of a group simply runs that
prompt once for its part. Nothing is added to ``Packed`` or ``TrainBatch``.

Falls back to ``response_logprobs`` (same result, no saving) when
* the model cannot share a cache (``shared_prompt_unsupported`` gives the reason: not a decoder-only
  transformers model, no cache argument (``past_key_values``, or ``cache`` since transformers 5.24) or no
  ``position_ids`` in its forward, a stateful/recurrent cache, sliding-window, chunked or non-full
  attention layers, ALiBi position biases computed from the attention mask, gradient checkpointing in
  training), or its prompt pass returns another cache
  than a ``DynamicCache`` of plain ``DynamicLayer`` s (checked at run time, remembered per model);
* the micro-batch is not laid out as ``pack`` lays it out (left padding, positions 0..len-1), a row
  has no prompt token, or sharing would not save at least ``min_saving`` of the positions computed.

Data parallel: with a ``DistributedDataParallel`` wrapper the prompt pass calls the wrapped module
directly and the completion pass calls the wrapper, so DDP runs its forward hook once per backward
(as with the plain forward); the gradient hooks fire once per parameter whichever pass used it.
This is correct with ``find_unused_parameters`` off (the trainer's setting) and on (the completion
pass's graph reaches every parameter the prompt pass used).

Source: the cache API is transformers' ``DynamicCache`` (``layers[i].keys/values``, shape
``[batch, kv_heads, seq, head_dim]``) and ``create_causal_mask`` with a 2D padding mask over
``cache + new`` positions (transformers 5.x, ``masking_utils.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from dataclasses import dataclass

import torch

from .chunked_logprobs import KLReference, fits_one_chunk, head_logprobs, logits_dtype, reference_kl
from .forward import Packed, decoder_hidden, head_parts, response_logprobs, unwrap
from .kv_cache import cache_kwarg, cache_name, output_cache

log = logging.getLogger(__name__)

# model -> why its cache cannot be shared (found at run time); weak, so models are not kept alive
_RUNTIME_REFUSALS: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_ALIBI_TYPES = ("bloom", "mpt")


def uses_alibi(config) -> bool:
    """Whether a (text) model config has ALiBi position biases, which transformers computes from the attention mask."""
    return bool(getattr(config, "alibi", False)) or getattr(config, "model_type", "") in _ALIBI_TYPES


def recurrent(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a DDP wrapper unwrapped) carries a recurrent state from token to token (Mamba, Jamba,
    Falcon-H1, OLMo-hybrid: transformers' ``_is_stateful``): its cache cannot be indexed by row, and sequences
    packed end to end would share the state."""
    return bool(getattr(unwrap(model), "_is_stateful", False))


def shared_prompt_unsupported(model: torch.nn.Module, inference: bool = False) -> str | None:
    """Why ``model`` cannot reuse a prompt's key/value cache for its completions, or None if it can.

    Decided from the model's class and config (cheap; called per micro-batch); a cache type found
    unsuitable at run time is remembered here too. Llama-family models (Llama, Qwen2/3 without
    sliding window, Mistral-like with ``sliding_window=None``) are supported. ``inference``: for a caller that runs
    the model in eval mode without gradient (generation), where gradient checkpointing is off whatever is set.
    """
    m = unwrap(model)
    if m in _RUNTIME_REFUSALS:
        return _RUNTIME_REFUSALS[m]
    cfg = getattr(m, "config", None)
    if cfg is None:
        return f"{type(m).__name__} has no transformers config"
    if getattr(cfg, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if recurrent(m):
        return "a stateful (recurrent) cache cannot be indexed by prompt"
    try:
        params = inspect.signature(m.forward).parameters
    except (TypeError, ValueError):
        return f"cannot read {type(m).__name__}.forward's signature"
    if cache_name(params) is None:
        return f"{type(m).__name__}.forward takes no past_key_values (or cache)"
    for name in ("position_ids", "attention_mask", "use_cache"):
        if name not in params:
            return f"{type(m).__name__}.forward takes no {name}"
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"non-full attention layers {sorted(set(layer_types) - {'full_attention'})}"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return f"sliding-window attention ({text.sliding_window})"
    if getattr(text, "attention_chunk_size", None):
        return "chunked attention"
    if uses_alibi(text):
        return "ALiBi position biases are computed from the attention mask"
    ckpt = getattr(m, "is_activation_checkpointing", None)  # transformers >= 5; older: is_gradient_checkpointing
    if ckpt is None:
        ckpt = getattr(m, "is_gradient_checkpointing", False)
    if ckpt and m.training and not inference:
        return "gradient checkpointing turns the cache off in training"
    return None


@dataclass
class PromptSplit:
    """A micro-batch split into distinct prompt prefixes and per-row completion segments.

    U distinct prefixes, P = longest prefix, B rows, C = completion width of the ``Packed``.
    """

    prefix_ids: torch.Tensor  # [U, P] long, right-padded with 0 (any valid id: never attended)
    prefix_len: torch.Tensor  # [U] long, 0..P
    group: torch.Tensor  # [B] long, row -> its prefix in 0..U-1
    seg_ids: torch.Tensor  # [B, C+1] long: last prompt token, the n_i completion tokens, then filler
    seg_pos: torch.Tensor  # [B, C+1] long: position ids (filler repeats the row's last position)
    n: torch.Tensor  # [B] long, completion tokens covered (from the first valid response position)
    plain_positions: int  # B·L, positions the plain forward computes
    shared_positions: int  # U·P + B·(C+1)

    @property
    def saving(self) -> float:
        """Fraction of the plain forward's positions the shared forward does not compute."""
        return 1.0 - self.shared_positions / max(self.plain_positions, 1)


def split_prompts(packed: Packed) -> PromptSplit | None:
    """Find the distinct prompts of a packed micro-batch; None when it is not laid out as ``pack`` does.

    A row's completion is taken to start at its first ``response_mask`` position (so a mask that
    hides tokens only moves tokens from the completion into the prompt, which stays exact); rows
    whose prompts (all but the last prompt token) are equal token for token share one prefix.
    Returns None (use the plain forward) if the attention mask is not left padding, the real
    positions are not 0..len-1, a row has no prompt token before its completion, or no row has a
    prefix (every prompt is one token).
    """
    ids, att, pos, resp = packed.input_ids, packed.attention_mask, packed.position_ids, packed.response_mask
    B, L = ids.shape
    C = resp.shape[1]
    dev = ids.device
    lens = att.sum(1)
    start = L - lens
    ar = torch.arange(L, device=dev)
    real = ar[None] >= start[:, None]
    if not torch.equal(att.bool(), real) or not torch.equal(torch.where(real, pos, 0), torch.where(real, ar[None] - start[:, None], 0)):
        return None
    has = resp.any(1)
    n = torch.where(has, C - resp.int().argmax(1), 0)  # argmax: the first True
    if bool((lens <= n).any()):
        return None  # no prompt token: the plain forward predicts the first token from padding
    P = lens - n - 1
    Pm = int(P.max())
    if Pm == 0:
        return None
    j = torch.arange(Pm, device=dev)
    pref = ids.gather(1, (start[:, None] + j[None]).clamp(max=L - 1))
    pref = torch.where(j[None] < P[:, None], pref, -1)  # -1: no token (ids are >= 0)
    uniq, group = torch.unique(pref, dim=0, return_inverse=True)
    k = torch.arange(C + 1, device=dev)
    seg_ids = ids.gather(1, ((L - n - 1)[:, None] + k[None]).clamp(max=L - 1))
    seg_pos = P[:, None] + torch.minimum(k[None], n[:, None])
    U = uniq.shape[0]
    return PromptSplit(uniq.clamp_min(0), (uniq >= 0).sum(1), group, seg_ids, seg_pos, n,
                       plain_positions=B * L, shared_positions=U * Pm + B * (C + 1))


def grouped_response_logprobs(model: torch.nn.Module, packed: Packed, *, with_entropy: bool = False,
                              temperature: float = 1.0, prompt_padding: str = "auto", min_saving: float = 0.1,
                              with_full: bool = False, chunk_size: int | None = None,
                              kl_reference: KLReference | None = None, entropy_grad: bool = False):
    """``response_logprobs`` with each distinct prompt of the micro-batch run once (a drop-in replacement).

    Args:
        model: a transformers causal LM, or a DistributedDataParallel wrapping one.
        packed: the micro-batch as ``forward.pack`` builds it (B rows, completion width C).
        with_entropy: also return the per-token entropy, as ``response_logprobs`` (with gradient when
            ``entropy_grad``, as there).
        temperature: divides the logits first.
        prompt_padding: layout of the prompt pass, "right" (prompts right-padded, no mask needed in
            the prompt pass: causal attention never looks ahead; the completion pass masks the
            filler), "left" (left-padded with a mask, as ``pack``), or "auto": "right" for the
            "sdpa" and "eager" attention implementations, "left" otherwise (e.g. flash-attention,
            which handles left padding but not holes in the mask).
        min_saving: use the shared forward only if it skips at least this fraction of the
            positions the plain forward computes (U·P + B·(C+1) against B·L); two model calls
            cost more than one on a micro-batch without repeated prompts. 0 or below: always.
        with_full: also return the whole log-softmax ``[B, C, V]`` at the completion positions,
            right-aligned like ``logp`` (for an exact KL), as a third item; as ``response_logprobs``.
        chunk_size: as ``response_logprobs``, in tokens: above B · (C + 1) ≤ chunk_size, the completion
            pass's hidden states go through ``chunked_logprobs`` (right-aligned first, so outputs and
            ``kl_reference`` share the ``pack`` layout); None or B · (C + 1) ≤ chunk_size: the full path.
        kl_reference: also return the exact KL ``[B, C]`` to it, as ``response_logprobs``.

    Returns:
        (logp, entropy): log π(y_t | prompt, y_<t) ``[B, C]`` in at least float32 (log-softmax of the
        logits upcast, as ``response_logprobs``) right-aligned like ``packed.response_mask``, and the
        entropy ``[B, C]`` or None; then the full log-softmax and the KL when asked, as ``response_logprobs``.
        Values outside ``response_mask`` are meaningless but finite.

    Raises:
        ValueError: an unknown ``prompt_padding``.
    """
    if prompt_padding not in ("auto", "left", "right"):
        raise ValueError(f"prompt_padding must be 'auto', 'left' or 'right', not {prompt_padding!r}")
    if shared_prompt_unsupported(model) is None:
        split = split_prompts(packed)
        if split is not None and (min_saving <= 0 or split.saving >= min_saving):
            out = _shared_forward(model, split, with_entropy=with_entropy, temperature=temperature,
                                  prompt_padding=prompt_padding, with_full=with_full, chunk_size=chunk_size,
                                  kl_reference=kl_reference, entropy_grad=entropy_grad)
            if out is not None:
                return out
    return response_logprobs(model, packed, with_entropy=with_entropy, temperature=temperature, with_full=with_full,
                             chunk_size=chunk_size, kl_reference=kl_reference, entropy_grad=entropy_grad)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)``, whose backward adds rows with ``index_add_`` on a contiguous [U, F] view."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.shape = x.shape[0], x.shape
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        flat = grad.reshape(grad.shape[0], -1)
        out = flat.new_zeros((ctx.rows, flat.shape[1])).index_add_(0, index, flat)
        return out.view(ctx.shape), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` [B] of ``x`` [U, ...] → [B, ...], differentiable: row u's gradient is the sum of the rows
    of the output gradient that ``index`` maps to u, added in row order.

    The same values and the same gradient, bit for bit, as ``x.index_select(0, index)`` under autograd,
    whose backward on the strided key/value gradients of a cache goes through ``scatter_add_`` (~9 ms for
    each key or value tensor of the lab's 512 × 4 × 18 × 32 cache, against ~0.3 ms for ``index_add_``
    here). Measured at one thread: the learner step 1.13× faster on the short task, bit for bit
    (``bench/gather_rows.py``; ``tests/integration/test_shared_prompt.py`` checks the equality).
    """
    return _GatherRows.apply(x, index)


def _is_plain_dynamic_cache(cache) -> bool:
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


def _shared_forward(model: torch.nn.Module, s: PromptSplit, *, with_entropy: bool, temperature: float,
                    prompt_padding: str, with_full: bool = False, chunk_size: int | None = None,
                    kl_reference: KLReference | None = None, entropy_grad: bool = False):
    """The two passes; None if the prompt pass's cache cannot be indexed (remembered for the model)."""
    if with_full and kl_reference is not None:
        raise ValueError("pass with_full or kl_reference, not both")
    m = unwrap(model)
    U, P = s.prefix_ids.shape
    B, C1 = s.seg_ids.shape
    C = C1 - 1
    dev = s.seg_ids.device
    if prompt_padding == "auto":
        prompt_padding = "right" if getattr(m.config, "_attn_implementation", "eager") in ("sdpa", "eager") else "left"
    j = torch.arange(P, device=dev)
    if prompt_padding == "right":
        p_ids, p_pos, p_att = s.prefix_ids, j.expand(U, P), None  # causal: real tokens never see the filler after them
        valid = j[None] < s.prefix_len[:, None]
    else:
        src = j[None] - (P - s.prefix_len)[:, None]  # left padding: token t of the prefix at column P - len + t
        valid = src >= 0
        p_ids = torch.where(valid, s.prefix_ids.gather(1, src.clamp_min(0)), 0)
        p_pos, p_att = src.clamp_min(0), valid.long()
    # The prompt pass goes to the bare module: under DDP the completion pass below is the one
    # wrapper call per backward, whose graph reaches every parameter through the cache.
    # no logits: the prompt pass is for its cache, and U rows of [U, 1, V] would escape the chunk budget
    out = m(input_ids=p_ids, attention_mask=p_att, position_ids=p_pos, use_cache=True,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=dev))
    cache = output_cache(out)
    del out
    if not _is_plain_dynamic_cache(cache) or any(layer.keys.shape[0] != U or layer.keys.shape[-2] != P
                                                 for layer in cache.layers):
        reason = f"its prompt pass returned {type(cache).__name__}, not a DynamicCache of full-attention layers"
        _RUNTIME_REFUSALS[m] = reason
        log.warning("shared-prompt forward off for %s: %s; using the plain forward", type(m).__name__, reason)
        return None
    for layer in cache.layers:  # differentiable gather: each prompt row's gradient sums over its completions
        layer.keys = gather_rows(layer.keys, s.group)
        layer.values = gather_rows(layer.values, s.group)
    # Filler after a row's completion is marked valid: causal attention keeps the real tokens
    # from seeing it, and it keeps every query row non-empty (no NaN from a fully masked row).
    att = torch.cat([valid.index_select(0, s.group).long(), torch.ones(B, C1, dtype=torch.long, device=dev)], 1)
    inputs = dict(input_ids=s.seg_ids, attention_mask=att, position_ids=s.seg_pos, use_cache=True,
                  **{cache_kwarg(m): cache})
    # right-align: output column j holds raw column j - (C - n_i); the columns before wrap onto filler
    src = (torch.arange(C, device=dev)[None] - (C - s.n)[:, None]) % C
    parts = None
    if not fits_one_chunk(B, C, chunk_size) and not (with_full and torch.is_grad_enabled()):
        parts = head_parts(m)
    if parts is not None:
        decoder, head = parts
        _, hidden = decoder_hidden(model, decoder, **inputs)
        hidden = hidden[:, :-1].gather(1, src[..., None].expand(-1, -1, hidden.shape[-1]))  # a permutation per row
        return head_logprobs(hidden, head, s.seg_ids[:, 1:].gather(1, src), chunk_size=chunk_size,
                             with_entropy=with_entropy, temperature=temperature, with_full=with_full,
                             kl_reference=kl_reference, entropy_grad=entropy_grad)
    out = model(**inputs, logits_to_keep=C1)
    del inputs
    logits = out.logits[:, :-1]
    del out, cache
    logits = logits.to(logits_dtype(logits.dtype))  # as response_logprobs: at least float32 whatever the model's dtype
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    raw = logp_all.gather(-1, s.seg_ids[:, 1:, None]).squeeze(-1)  # [B, C], row i's tokens at 0..n_i-1
    logp = raw.gather(1, src)
    ent = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1).gather(1, src)
    if not with_full and kl_reference is None:
        return logp, ent
    full = logp_all.gather(1, src[..., None].expand(-1, -1, logp_all.shape[-1]))
    return (logp, ent, full) if with_full else (logp, ent, reference_kl(full, kl_reference))
