"""The learning-rate schedule: linear warm-up, then constant, linear decay or cosine decay, as a multiplier of lr.

The warm-up reaches ``lr`` at its last step, ``(s + 1) / warmup`` (the first optimizer step already moves: Adam's first
bias-corrected steps are close to ``lr·sign(g)`` on every weight, a large random kick to a warmed-up policy when the
policy gradient is noisy, so it starts small rather than at 0). The decays are transformers' ``linear`` and ``cosine``
schedules (``get_linear_schedule_with_warmup``, ``get_cosine_schedule_with_warmup``) after that warm-up: from 1 at
step ``warmup`` to 0 at step ``total``.
"""

from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """``f(s)``: the factor on ``lr`` at optimizer step ``s`` (0-based), for ``torch.optim.lr_scheduler.LambdaLR``.

    ``total`` is the run's optimizer steps (rounds × epochs × minibatches); past it the decays stay at 0.

    Raises:
        ValueError: an unknown ``kind``, or a negative ``warmup``.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {SCHEDULES}, not {kind!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return f
