"""The reward settings of a run as one value: which scorer (or weighted scorers), how many scoring processes, the
limits.

A ``RewardSpec`` is plain data (picklable): the trainer and every rollout worker build their own pool and
failure check from the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .functions import Terms, WeightedRewards, make_reward
from .pool import RewardPool
from .scorers import ScoreResult, check_scoring


@dataclass(frozen=True)
class RewardSpec:
    """name: the scorer (``rewards.get``), or (scorer, weight) terms summed (``rewards.make_reward``; a reward
    model's term is ``rm:DIR``, which only the trainer's process loads). workers:
    scoring processes (0: in this process, no time limit). timeout_s: seconds per completion (reward 0, counted).
    max_failure_rate: the fraction of a scoring call's completions that may fail (errors + timeouts) before the run
    stops, in [0, 1]."""

    name: str | Terms
    workers: int = 2
    timeout_s: float = 10.0
    max_failure_rate: float = 1.0

    @property
    def scorer(self) -> str:
        """The reward's name in messages: the scorer's, or its weighted terms'."""
        return self.name if isinstance(self.name, str) else WeightedRewards.describe(self.name)

    def pool(self, load_model: Callable[[str], object] | None = None) -> RewardPool | WeightedRewards:
        """A new pool of this reward (``rewards.make_reward``; ``load_model`` builds a reward-model term's scorer, as
        ``WeightedRewards`` says); the caller closes it."""
        return make_reward(self.name, workers=self.workers, timeout_s=self.timeout_s, load_model=load_model)

    def check(self, where: str, warn: Callable[[str], None] | None = None) -> Callable[[ScoreResult, int], None]:
        """``check(result, n)`` for each scoring call of ``n`` completions: ``warn`` hears any failure (one line),
        and past ``max_failure_rate`` it raises; ``where`` names what was scored in the messages.

        Raises:
            UserError: from the returned function, too many failures (``rewards.check_scoring``).
        """

        def check(result: ScoreResult, n: int) -> None:
            warning = check_scoring(result, n=n, scorer=self.scorer, max_failure_rate=self.max_failure_rate,
                                    where=where)
            if warning and warn is not None:
                warn(warning)

        return check
