"""Packing prompt + completion ids into model inputs, and per-token log-probs of the completions.

Layout: every sequence is ``prompt + completion`` left-padded to a common length L, so the
completions are right-aligned and occupy the last C = max completion length positions. Tensors
over the response are therefore ``[B, C]``, the ``[B, T]`` of the objectives.

With ``chunk_size`` (the learner's ``logprob_chunk_size``, in tokens) below the full path's B · (C + 1)
logit positions (``chunked_logprobs.fits_one_chunk``), the model is called
with its LM head on no position and the decoder's hidden states go through ``chunked_logprobs``:
no [B, C, V] logits are kept for backward. The call goes through the module it is given (a DDP
wrapper included: one wrapper forward per backward, as before); the head's own weight Parameter
enters the chunked op, so tied embeddings and data-parallel gradient hooks see its gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from .chunked_logprobs import (HeadInput, KLReference, TeacherForced, autocast_state, fits_one_chunk, full_logprobs,
                               head_logprobs)


@dataclass
class Packed:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long
    response_mask: torch.Tensor  # [B, C] bool, valid completion tokens

    def select(self, idx: torch.Tensor | slice) -> "Packed":
        return Packed(self.input_ids[idx], self.attention_mask[idx], self.position_ids[idx], self.response_mask[idx])

    def to(self, device: torch.device | str) -> "Packed":
        """The same tensors on ``device`` (no copy when they are there already)."""
        return Packed(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                      self.response_mask.to(device))


def refuse_empty_prompts(prompts: list[list[int]]) -> None:
    """ValueError naming the first prompt without a token: its completion's first token has no position to be
    scored (or sampled) from."""
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise ValueError(f"prompt {empty} has no token; every prompt needs at least one (a BOS token counts)")


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Packed:
    """Left-pad ``prompt + completion`` pairs. Raises ValueError on empty prompts or completions (a completion's
    first token is scored from the prompt's last position) or a length mismatch."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token (EOS counts)")
    refuse_empty_prompts(prompts)
    seqs = [p + c for p, c in zip(prompts, completions)]
    L = max(len(s) for s in seqs)
    C = max(len(c) for c in completions)
    B = len(seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    resp = torch.zeros((B, C), dtype=torch.bool)
    for i, (s, c) in enumerate(zip(seqs, completions)):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        att[i, L - len(s):] = 1
        resp[i, C - len(c):] = True
    pos = (att.cumsum(1) - 1).clamp_min(0)
    return Packed(ids, att, pos, resp)


# transformers model types whose logits are exactly ``lm_head(decoder(...).last_hidden_state)`` (no soft-capping
# or logit scaling after the head): the chunked head may take their hidden states
CHUNKED_HEAD_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DistributedDataParallel (or similar ``.module``) wrapper."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def head_parts(model: torch.nn.Module, *, linear: bool = True) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, LM head) of a standard transformers causal LM, or None: the chunked head cannot serve it.

    Only model types in ``CHUNKED_HEAD_TYPES`` with an output embedding (tied or not) and a decoder distinct from
    the model qualify; any other model keeps the full path. ``linear``: the head must be a ``torch.nn.Linear``
    (the learner's chunked head takes its weight); False accepts any module (a quantized behaviour copy's head,
    only ever called).
    """
    m = unwrap(model)
    if getattr(getattr(m, "config", None), "model_type", None) not in CHUNKED_HEAD_TYPES:
        return None
    try:
        head, decoder = m.get_output_embeddings(), m.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if not isinstance(head, torch.nn.Linear if linear else torch.nn.Module) or decoder is None or decoder is m:
        return None
    return decoder, head


@dataclass(frozen=True, eq=False)
class Teacher:
    """A model the learner rebuilds a sampling distribution from by teacher forcing, instead of storing it.

    The distribution sampled at each position is softmax(logits / ``temperature``) of ``model`` (in eval mode)
    under ``autocast`` (a dtype, or None: off): what the transformers engine samples from with top-p = 1
    (``rollout.TransformersEngine.teacher``), and what ``teacher_forced`` recomputes. ``name`` says which model
    it is in messages.
    """

    model: torch.nn.Module
    temperature: float = 1.0
    autocast: torch.dtype | None = None
    name: str = "the behaviour policy"


@dataclass(frozen=True)
class Recorded:
    """In place of a ``Teacher``: the rows of this policy version carry the distribution they were sampled from,
    recorded at each decoding step (``TrainBatch.behavior_logprobs_full``), because teacher forcing their model
    does not rebuild it (an engine in a precision other than float32, ``rollout.spec.behaviour_distribution``)."""

    name: str = "the behaviour policy"


@dataclass(frozen=True)
class TopK:
    """In place of a ``Teacher``: the rows of this policy version carry only the top-``k`` log-probs of the
    distribution they were sampled from, at each decoding step (``TrainBatch.behavior_top_logprobs`` and
    ``behavior_top_ids``): an engine whose model the learner cannot rebuild (vLLM, ``rollout.spec``'s "top_k").
    The exact KL there is the top-k lower bound (``objectives.kl.top_k_kl_lower_bound``)."""

    k: int
    name: str = "the behaviour policy"


@torch.no_grad()
def teacher_forced(packed: Packed, teachers: Sequence[tuple[torch.Tensor | None, Teacher]]) -> TeacherForced:
    """Each teacher's distribution at the response positions of its rows of ``packed``, as ``TeacherForced``.

    ``teachers``: (rows, teacher) pairs, rows a long tensor of row indices or None for every row. Each teacher
    runs one forward without gradient, in eval mode, under its autocast state, over its rows (the same layout
    as the learner's forward, so the same positions); what is kept is the decoder's hidden states ``[b, C, H]``
    and the LM head, whose logits ``TeacherForced`` computes a chunk of columns at a time, never ``[b, C, V]``.
    A model ``head_parts`` cannot split keeps its logits ``[b, C, V]`` (the learner's own full path holds as much).
    """
    C = packed.response_mask.shape[1]
    parts = []
    for rows, t in teachers:
        sub = packed if rows is None else packed.select(rows)
        inputs = dict(input_ids=sub.input_ids, attention_mask=sub.attention_mask, position_ids=sub.position_ids,
                      use_cache=False)
        with teaching(t, sub.input_ids.device.type) as m:
            split = head_parts(m, linear=False)
            if split is None:
                states, head = m(**inputs, logits_to_keep=C + 1).logits[:, :-1], None
            else:
                decoder, head = split
                states = last_hidden(decoder(**inputs))[:, -(C + 1):-1]
        parts.append(HeadInput(states, head, rows, t.temperature, t.autocast))
    return TeacherForced(tuple(parts), packed.response_mask.shape[0])


@contextlib.contextmanager
def teaching(teacher: Teacher, device_type: str):
    """``teacher``'s model (unwrapped) in eval mode under the teacher's autocast state, its mode restored after."""
    m = unwrap(teacher.model)
    was_training = m.training
    m.eval()
    try:
        with autocast_state(device_type, teacher.autocast):
            yield m
    finally:
        m.train(was_training)


def last_hidden(out) -> torch.Tensor:
    """A decoder output's last hidden state ``[B, L, H]`` (a ``ModelOutput`` or a tuple)."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def decoder_hidden(model: torch.nn.Module, decoder: torch.nn.Module, **inputs):
    """Call ``model`` once (a DDP wrapper's forward included) with its LM head on no position; return
    (the model's output, the decoder's last hidden state ``[B, L, H]``).

    The empty ``logits_to_keep`` makes the head compute ``[B, 0, V]`` logits; the hidden states are
    taken from the decoder's output by a forward hook, so the wrapper's forward runs as usual.
    """
    seen = []

    def grab(_mod, _args, out):
        seen.append(last_hidden(out))

    hook = decoder.register_forward_hook(grab)
    try:
        out = model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
    finally:
        hook.remove()
    if len(seen) != 1:
        raise RuntimeError(f"the decoder ran {len(seen)} times in one forward; expected once")
    return out, seen[0]


def response_logprobs(model: torch.nn.Module, packed: Packed, *, with_entropy: bool = False, temperature: float = 1.0,
                      with_full: bool = False, chunk_size: int | None = None, kl_reference: KLReference | None = None,
                      entropy_grad: bool = False):
    """Log π(y_t | c_t) for the completion tokens ``[B, C]``, and optionally the entropy ``[B, C]``.

    Log-probs are the log-softmax of the logits upcast to at least float32 (float32 for a float32 or
    bf16 model). Values at positions outside ``response_mask`` are meaningless (the caller masks them).
    ``temperature`` divides the logits first (to score a policy at T ≠ 1).

    Args:
        chunk_size: tokens (rows × columns) per LM-head chunk. None, or B · (C + 1) ≤ chunk_size, or a
            model ``head_parts`` does not serve: the full path, which computes the last C + 1 positions'
            logits (``logits_to_keep``). Otherwise the LM head runs on the decoder's hidden states at
            most ``chunk_size`` positions at a time (``chunked_logprobs``): no [B, C, V] logits are kept,
            the same values up to round-off.
        with_full: also return the whole log-softmax ``[B, C, V]`` at the completion positions (for an
            exact KL): with gradient on the full path; without gradient enabled the chunked path
            builds it chunk by chunk, with gradient it takes the full path.
        kl_reference: also return the exact KL(π_θ ‖ π_ref) ``[B, C]`` per position, with gradient
            (``chunked_logprobs.KLReference``; 0 outside its mask).
        entropy_grad: with ``with_entropy``, the entropy carries gradient (an entropy bonus), on either path
            (``chunked_logprobs.chunked_logprobs``); False: no gradient, and the backward is as without entropy.

    Returns:
        (logp, entropy or None), then the full log-softmax if ``with_full``, then the KL if ``kl_reference``.

    Raises:
        ValueError: both ``with_full`` and ``kl_reference``.
    """
    if with_full and kl_reference is not None:
        raise ValueError("pass with_full or kl_reference, not both")
    C = packed.response_mask.shape[1]
    targets = packed.input_ids[:, -C:]
    inputs = dict(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids,
                  use_cache=False)
    parts = None
    if not fits_one_chunk(targets.shape[0], C, chunk_size) and not (with_full and torch.is_grad_enabled()):
        parts = head_parts(model)
    if parts is None:
        logits = model(**inputs, logits_to_keep=C + 1).logits[:, :-1]
        return full_logprobs(logits, targets, with_entropy=with_entropy, temperature=temperature, with_full=with_full,
                             kl_reference=kl_reference, entropy_grad=entropy_grad)
    decoder, head = parts
    _, hidden = decoder_hidden(model, decoder, **inputs)
    return head_logprobs(hidden[:, -(C + 1):-1], head, targets, chunk_size=chunk_size, with_entropy=with_entropy,
                         temperature=temperature, with_full=with_full, kl_reference=kl_reference,
                         entropy_grad=entropy_grad)


def trim(packed: Packed) -> Packed:
    """``packed`` without its leading columns that no row uses: padding shared by every row.

    A batch is padded to its longest row; a micro-batch of shorter rows keeps that width. Drops the
    sequence columns before the first attended one (left padding) and the response columns before
    the first valid one, keeping at least one response column and one position before it.
    Positions, masks and tokens of the real rows are unchanged, so the log-probs are the same up to
    float summation order.
    """
    ids, att, resp = packed.input_ids, packed.attention_mask, packed.response_mask
    L, C = ids.shape[1], resp.shape[1]
    used = resp.any(0)
    c = C - int(used.int().argmax()) if bool(used.any()) else 1
    seq = att.bool().any(0)
    n = L - int(seq.int().argmax()) if bool(seq.any()) else 0
    n = min(L, max(n, c + 1))
    return Packed(ids[:, L - n:], att[:, L - n:], packed.position_ids[:, L - n:], resp[:, C - c:])


def trimmed(forward_fn):
    """``forward_fn`` (as ``response_logprobs``) run on ``trim(packed)``, its outputs left-padded back to C.

    A ``kl_reference`` is narrowed to the same columns. The outputs ([B, c] log-probs, entropy and KL,
    [B, c, V] full log-softmax) get zero columns on the left
    (outside ``response_mask``, where values are meaningless), so callers see the usual ``[B, C]``.
    """
    def fn(model, packed: Packed, **kw):
        narrow = trim(packed)
        pad = packed.response_mask.shape[1] - narrow.response_mask.shape[1]
        if pad and kw.get("kl_reference") is not None:
            kw["kl_reference"] = kw["kl_reference"].columns(pad)
        out = forward_fn(model, narrow, **kw)
        if pad == 0:
            return out
        return tuple(None if t is None else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (pad, 0))
                     for t in out)

    fn.__wrapped__ = forward_fn
    return fn
