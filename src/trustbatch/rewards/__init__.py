"""Reward scorers: ``score(completion: str, reference: str) -> float`` in [0, 1].

Names (``get``):
- ``math``: final answer (last ``\\boxed{}``, else last number) verified by math-verify;
- ``gsm8k``: the number after ``####``;
- ``countdown``: an expression over the given numbers that equals the target;
- ``rg:TASK``: a reasoning-gym task's own ``score_answer``;
- ``module:function``: a user function with the scorer signature.

``RewardPool`` runs any of them in worker processes with a time limit; ``score_all`` runs one in
this process. Neither raises on a scorer's error: the reward is 0 and the error is counted.
"""

from __future__ import annotations

import importlib
import json
import math
from typing import Callable

from ..errors import UserError
from .countdown import countdown_reward
from .gsm8k import gsm8k_reward
from .math_answer import math_reward
from .pool import RewardPool, ScoreResult

Scorer = Callable[[str, str], float]

BUILTIN: dict[str, Scorer] = {"math": math_reward, "gsm8k": gsm8k_reward, "countdown": countdown_reward}


class ReasoningGymScorer:
    """Scores with the reasoning-gym task's ``score_answer(answer, entry)``; the reference is the entry as JSON."""

    def __init__(self, task: str):
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            raise UserError(f"unknown reasoning-gym task {task!r} in reward 'rg:{task}'")
        self.task = task
        self._ds = reasoning_gym.create_dataset(task, size=1, seed=0)

    def __call__(self, completion: str, reference: str) -> float:
        entry = json.loads(reference)
        return float(self._ds.score_answer(completion.strip(), entry))


def get(name: str) -> Scorer:
    """The scorer named ``name`` (see the module docstring).

    Raises:
        UserError: unknown name, a reasoning-gym task that does not exist, or a ``module:function``
            that cannot be imported or is not callable.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith("rg:"):
        return ReasoningGymScorer(name[3:])
    if ":" in name:
        mod, _, fn = name.partition(":")
        try:
            f = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise UserError(f"cannot load reward function {name!r}: {e}") from None
        if not callable(f):
            raise UserError(f"reward {name!r} is not callable")
        return f
    raise UserError(f"unknown reward {name!r}; use one of {sorted(BUILTIN)}, 'rg:TASK' or 'module:function'")


def score_all(scorer: Scorer, completions: list[str], references: list[str]) -> tuple[list[float], int]:
    """Score each completion in this process; a scorer that raises or returns a non-finite value gives 0.

    Returns (rewards, number of errors). Rewards are clamped to [0, 1]. No time limit: use
    ``RewardPool`` for that.
    """
    out, errors = [], 0
    for c, r in zip(completions, references):
        try:
            v = float(scorer(c, r))
            if not math.isfinite(v):
                raise ValueError("non-finite reward")
        except Exception:
            v, errors = 0.0, errors + 1
        out.append(min(1.0, max(0.0, v)))
    return out, errors


__all__ = ["BUILTIN", "ReasoningGymScorer", "RewardPool", "ScoreResult", "Scorer", "get", "score_all"]
