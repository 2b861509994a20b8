"""Reward scorers: ``score(completion: str, reference: str) -> float`` in [0, 1].

Names: ``rg:TASK`` (a reasoning-gym task's own ``score_answer``) and ``module:function`` (a user
function with the same signature). ``score_all`` never raises on a scorer's error: the reward is 0
and the error is counted.
"""

from __future__ import annotations

import importlib
import json
import math
from typing import Callable

from ..errors import UserError

Scorer = Callable[[str, str], float]


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
    """The scorer named ``name``; UserError if it cannot be found."""
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
    raise UserError(f"unknown reward {name!r}; use 'rg:TASK' or 'module:function'")


def score_all(scorer: Scorer, completions: list[str], references: list[str]) -> tuple[list[float], int]:
    """Score each completion; a scorer that raises or returns a non-finite value gives 0.

    Returns (rewards, number of errors). Rewards are clamped to [0, 1].
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
