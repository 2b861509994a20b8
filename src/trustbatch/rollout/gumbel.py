"""The transformers engine's sampler, shared by its decode loops: Gumbel-max over per-row random streams.

token = argmax(s + g), s the processed scores (logits / T, top-p filtered), g standard Gumbel noise
-log(-log(u)) with u uniform on [0, 1) drawn from the row's own ``torch.Generator`` (Gumbel 1954; the Gumbel-max
trick: the argmax is distributed as softmax(s)). Both decode loops (``generate``'s, ``rollout.static_decode``'s)
call these two functions, so the same seeds give the same noise and the same recorded log-probs whichever loop runs.
"""

from __future__ import annotations

import torch


def row_uniforms(gens: list[torch.Generator], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One step of every row's stream: [len(gens), vocab] float32 uniforms on [0, 1), moved to ``device``.

    Row r is ``torch.rand(vocab, generator=gens[r])`` on the CPU (so the numbers do not depend on the device the
    model runs on), advancing that generator by one step.
    """
    return torch.stack([torch.rand(vocab, generator=g) for g in gens]).to(device)


def gumbel_pick(scores: torch.Tensor, u: torch.Tensor | None, record: bool = False):
    """The sampled token and its behaviour log-prob from one step's processed scores.

    Args:
        scores: [N, V] processed scores (after temperature and top-p; -inf outside the nucleus).
        u: [N, V] uniforms (``row_uniforms``) on the scores' device, or None for greedy decoding (argmax of scores).
        record: also return the whole log-softmax.

    Returns:
        (noisy, token, logp, lsm): noisy [N, V] = scores + Gumbel noise (what ``generate`` takes the argmax of),
        token [N, 1] long = argmax(noisy), logp [N] = log_softmax(scores) at token in at least float32 (the processed
        distribution sampled from, without noise), lsm [N, V] that log-softmax when ``record`` else None.
    """
    noisy = scores
    if u is not None:
        noisy = scores - torch.log(-torch.log(u.clamp_min(1e-20)))
    token = noisy.argmax(-1, keepdim=True)
    # generate's scores are float32 whatever the model (it casts each step's logits); promote in case it changes
    lsm = torch.log_softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return noisy, token, lsm.gather(-1, token).squeeze(-1), (lsm if record else None)
