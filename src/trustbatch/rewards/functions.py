"""Several reward functions with weights, as TRL's ``reward_funcs``/``reward_weights``: r = Σ_i w_i · r_i.

Each function is scored by its own ``RewardPool``, so the time limit, the failure counts and the worker processes
apply to every function and form (per-completion ``score(completion, reference)`` or TRL's batch form,
``scorers.BatchForm``). Each r_i is what its function returned, outside [0, 1] too (TRL sums its ``reward_funcs``
so: a format penalty of −1 or a length bonus in [−0.5, 0.5] stays what it is; ``scorers.settle``), where one
scorer alone (``reward.name``, a task's correctness in [0, 1]) is clamped. A failure of any function scores that
function 0 and counts once in the round's failure rate, which is over completions × functions; each function's own
failure rate (over completions) is judged against ``reward.max_failure_rate`` too, so one that always fails stops
the run however many others score.

A term named ``rm:DIR`` is a reward model (``reward.model``), not a function: ``WeightedRewards`` scores it with what
its ``load_model`` returns for DIR (``policy.reward_model.RewardModel``, built by the recipes on the learner's
device), in this process and unclamped; without ``load_model`` such a term is refused (``scorers.get``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .pool import RewardPool
from .scorers import MODEL_PREFIX, ScoreResult, is_model, merge_extra, merge_logged

Terms = tuple[tuple[str, float], ...]  # (scorer name, weight) per reward function


def labels(names: Sequence[str]) -> list[str]:
    """A metric label per reward function: the function's name (``module:fn`` → ``fn``, ``python:f.<locals>.g`` →
    ``g``, a reward model ``rm:DIR`` → ``reward_model``), ``#k`` added to repeats."""
    base = ["reward_model" if is_model(n) else n.rpartition(":")[2].rpartition(".")[2] if n.startswith("python:")
            else n.rpartition(":")[2] if ":" in n and not n.startswith(("rg:", "rg-final:")) else n for n in names]
    return [b if base.count(b) == 1 else f"{b}#{base[:k].count(b)}" for k, b in enumerate(base)]


class WeightedRewards:
    """Score with every function of ``terms`` and combine: reward_j = Σ_i w_i · r_i(completion_j).

    The result's ``components`` holds each function's rewards by ``labels``; ``functions`` is len(terms). Same
    interface as ``RewardPool`` (``score``, ``close``, ``in_process_marker``), so a rollout source takes either.

    ``load_model(DIR)``: the scorer of a reward-model term ``rm:DIR`` (module docstring), with the interface of a
    ``RewardPool``.

    Raises:
        UserError: at construction, from ``RewardPool`` (an unknown scorer or one that fails to import), a
            reward-model term without ``load_model``, or ``load_model``'s own.
    """

    def __init__(self, terms: Terms, *, workers: int = 2, timeout_s: float = 10.0, chunk_size: int = 32,
                 load_model: Callable[[str], object] | None = None):
        self.terms = tuple((str(n), float(w)) for n, w in terms)
        self.labels = labels([n for n, _ in self.terms])
        self.name = self.describe(self.terms)
        self.pools = []
        try:
            for n, _ in self.terms:
                self.pools.append(load_model(n[len(MODEL_PREFIX):]) if is_model(n) and load_model is not None
                                  else RewardPool(n, workers=workers, timeout_s=timeout_s, chunk_size=chunk_size,
                                                  clamp=False))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def describe(terms: Terms) -> str:
        """``terms`` as one name for messages, e.g. ``1·gsm8k + 0.2·fmt:length``."""
        return " + ".join(f"{float(w):g}·{n}" for n, w in terms)

    @property
    def in_process_marker(self):
        return self.pools[0].in_process_marker

    @in_process_marker.setter
    def in_process_marker(self, path) -> None:
        for p in self.pools:
            p.in_process_marker = path

    def score(self, completions: list[str], references: list[str], *, contexts: list[dict] | None = None,
              max_failure_rate: float | None = None) -> ScoreResult:
        """The weighted rewards of ``completions`` (one per completion), with each function's own in ``components``.

        ``contexts`` and ``max_failure_rate`` as in ``RewardPool.score`` (the early stop applies per function).
        """
        parts = [p.score(completions, references, contexts=contexts, max_failure_rate=max_failure_rate)
                 for p in self.pools]
        rewards = [sum(w * part.rewards[j] for (_, w), part in zip(self.terms, parts)) for j in range(len(completions))]
        last = [f"{lab}: {p.last_error}" for lab, p in zip(self.labels, parts) if p.last_error]
        nowhere = set.intersection(*(set(p.none) for p in parts))  # no function applies: TRL's NaN reward
        return ScoreResult(rewards, sum(p.errors for p in parts), sum(p.timeouts for p in parts),
                           sum(p.clamped for p in parts), last[-1] if last else None, sum(p.unscored for p in parts),
                           {lab: _applied(p) for lab, p in zip(self.labels, parts)}, len(parts),
                           {lab: (p.errors + p.timeouts, p.last_error) for lab, p in zip(self.labels, parts)},
                           sorted(nowhere), merge_logged([p.logged for p in parts]),
                           merge_extra([p.extra for p in parts]))

    def close(self) -> None:
        for p in self.pools:
            p.close()

    def __enter__(self) -> "WeightedRewards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _applied(part: ScoreResult) -> list[float]:
    """One function's rewards with NaN where it said it does not apply (None: 0 in the sum, as TRL's nansum), so
    that its logged mean leaves them out, as TRL's nanmean does."""
    none = set(part.none)
    return [math.nan if j in none else v for j, v in enumerate(part.rewards)]


def make_reward(reward: str | Terms, *, workers: int = 2, timeout_s: float = 10.0,
                load_model: Callable[[str], object] | None = None) -> RewardPool | WeightedRewards:
    """A ``RewardPool`` for one scorer name, a ``WeightedRewards`` for a tuple of ``(name, weight)`` (``load_model``:
    as there)."""
    if isinstance(reward, str):
        return RewardPool(reward, workers=workers, timeout_s=timeout_s)
    return WeightedRewards(reward, workers=workers, timeout_s=timeout_s, load_model=load_model)
