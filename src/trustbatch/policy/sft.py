"""Supervised fine-tuning on task demonstrations (prompt → gold answer), loss on completion tokens only."""

from __future__ import annotations

import random
from typing import Callable

import torch

from .budget import logit_tokens, vocab_size
from .forward import pack, response_logprobs
from .model import Policy


def demos_within_context(policy: Policy, demos: list[tuple[str, str]]):
    """``(kept, lengths, context)``: the demonstrations whose prompt and completion ids (EOS included) fit the
    model's context (``config.max_position_embeddings``), and every demonstration's length in tokens; ``(demos, [],
    None)`` when the config names no context."""
    context = getattr(policy.model.config, "max_position_embeddings", None)
    if context is None:
        return demos, [], None
    lengths = [len(policy.encode_prompt(p)) + len(policy.encode_completion(c)) for p, c in demos]
    return [d for d, n in zip(demos, lengths) if n <= context], lengths, context


def sft(
    policy: Policy,
    demos: list[tuple[str, str]],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Train ``policy`` in place on (prompt, completion) pairs for ``steps`` AdamW steps.

    The loss is the token-mean negative log-likelihood of completion tokens (EOS included). AdamW (betas 0.9, 0.98;
    no weight decay; gradient norm clipped at 1.0) at ``lr`` times the product of a linear warm-up over the first 10%
    of steps, (s + 1)/W, and a cosine over all steps, (1 + cos(π s / steps))/2: the peak is below ``lr`` (0.976 of
    it at 600 steps), not transformers' warm-up-then-cosine; kept so, as every cached and shipped base was built with
    it. The LM head runs in chunks of the learner's
    budget (``budget.logit_tokens``: 256 MiB of float32 logits). Returns the last loss.
    Raises ValueError on an empty ``demos`` list.
    """
    if not demos:
        raise ValueError("SFT needs at least one demonstration")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    enc = [(policy.encode_prompt(p), policy.encode_completion(c)) for p, c in demos]
    model = policy.model
    # the learner's LM-head budget: no [batch, C + 1, V] logits past it (the full path below it, as before)
    chunk = logit_tokens(vocab_size(model))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / max(1, steps))).item())
    )
    loss_v = float("nan")
    for step in range(steps):
        batch = [enc[rng.randrange(len(enc))] for _ in range(batch_size)]
        packed = pack([b[0] for b in batch], [b[1] for b in batch], policy.pad_id)
        logp, _ = response_logprobs(model, packed, chunk_size=chunk)
        m = packed.response_mask
        loss = -(logp * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
        if on_step is not None:
            on_step(step, loss_v)
    model.eval()
    return loss_v
