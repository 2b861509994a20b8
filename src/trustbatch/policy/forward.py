"""Packing prompt + completion ids into model inputs, and per-token log-probs of the completions.

Layout: every sequence is ``prompt + completion`` left-padded to a common length L, so the
completions are right-aligned and occupy the last C = max completion length positions. Tensors
over the response are therefore ``[B, C]``, the ``[B, T]`` of the objectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Packed:
    """Left-pad ``prompt + completion`` pairs. Raises ValueError on empty completions or length mismatch."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token (EOS counts)")
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


def response_logprobs(model: torch.nn.Module, packed: Packed, *, with_entropy: bool = False, temperature: float = 1.0,
                      with_full: bool = False):
    """Log π(y_t | c_t) for the completion tokens, float32 ``[B, C]``, and optionally the entropy ``[B, C]``.

    Only the last C + 1 positions' logits are computed (``logits_to_keep``). Values at positions
    outside ``response_mask`` are meaningless (the caller masks them). ``temperature`` divides the
    logits first (to score a policy at T ≠ 1). ``with_full=True`` returns a third item, the whole
    log-softmax ``[B, C, V]`` at the completion positions, with gradient (for an exact KL).
    """
    C = packed.response_mask.shape[1]
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        logits_to_keep=C + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = packed.input_ids[:, -C:]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return (logp, ent, logp_all) if with_full else (logp, ent)


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

    The outputs ([B, c] log-probs and entropy, [B, c, V] full log-softmax) get zero columns on the left
    (outside ``response_mask``, where values are meaningless), so callers see the usual ``[B, C]``.
    """
    def fn(model, packed: Packed, **kw):
        narrow = trim(packed)
        pad = packed.response_mask.shape[1] - narrow.response_mask.shape[1]
        out = forward_fn(model, narrow, **kw)
        if pad == 0:
            return out
        return tuple(None if t is None else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (pad, 0))
                     for t in out)

    fn.__wrapped__ = forward_fn
    return fn
