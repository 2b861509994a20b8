"""``trustbatch eval``: pass@k of a model on benchmarks, with the training engines and reward pool.

For each benchmark, n completions per prompt are sampled and scored; pass@k is the unbiased
estimator (Chen et al. 2021, arXiv 2107.03374, Eq. 1) averaged over prompts, with its standard
error over prompts. The average over benchmarks weights each benchmark equally.
"""

from __future__ import annotations

import math
from typing import Callable

from ..rewards import ScoreResult, check_scoring
from .sampling import sample_and_score


def evaluate_benchmarks(policy, engine, benchmarks, make_pool, *, n: int, ks: list[int], temperature: float,
                        max_new_tokens: int, progress=None, warn: Callable[[str], None] | None = None) -> dict:
    """Return ``{"benchmarks": {name: {...}}, "average": {...}}``.

    ``benchmarks``: a list of ``data.benchmarks.Benchmark``; ``make_pool(reward_name)`` gives a
    RewardPool; ``progress`` is a rich Progress (optional). Per benchmark: ``prompts``,
    ``pass@k`` and ``pass@k_se`` for each k, ``reward_mean``, ``reward_errors``,
    ``reward_timeouts``, ``reward_clamped``, ``response_tokens``, ``truncated_fraction`` and ``correct``
    (per-prompt counts of correct samples out of n, for any later re-analysis). ``warn(message)`` hears, once per
    benchmark, the warning a training round gives (``rewards.check_scoring``) when a scorer failed or returned a
    reward outside [0, 1] (clamped into it, so a scorer returning 5 counts as correct); evaluation never stops for
    failures (they are counted and scored 0).

    Raises:
        ValueError: a k outside 1..n.
    """
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"every k must be in 1..n={n}; got {bad}")
    out: dict = {"benchmarks": {}}
    for b in benchmarks:
        task = progress.add_task(b.name, total=len(b.examples)) if progress is not None else None
        calls: list[ScoreResult] = []  # each scoring call's counts, without its rewards
        with make_pool(b.reward) as pool:
            s = sample_and_score(policy, engine, b.examples, pool, n=n, temperature=temperature,
                                 max_new_tokens=max_new_tokens, chunk_prompts=max(1, 256 // n),
                                 on_progress=(lambda d, t=task: progress.update(t, completed=d)) if progress else None,
                                 check=lambda r, _n: calls.append(ScoreResult([], r.errors, r.timeouts, r.clamped,
                                                                              r.last_error)))
        scored = sum(calls, ScoreResult([], 0, 0))
        # a rate of 1 never refuses: an evaluation reports its failures rather than stopping
        warning = check_scoring(scored, scorer=getattr(pool, "name", b.reward), max_failure_rate=1.0, where=b.name,
                                n=n * len(b.examples))
        if warning and warn is not None:
            warn(warning)
        row = {"prompts": len(b.examples), "reward": getattr(pool, "name", b.reward)}  # the scorer that scored
        for k in ks:
            row[f"pass@{k}"], row[f"pass@{k}_se"] = s.pass_at(k)
        row.update(reward_mean=s.reward_mean, reward_errors=s.reward_errors, reward_timeouts=s.reward_timeouts,
                   reward_clamped=scored.clamped, response_tokens=s.response_tokens, truncated_fraction=s.truncated_fraction, correct=s.correct)
        out["benchmarks"][b.name] = row
    rows = list(out["benchmarks"].values())
    avg = {}
    for k in ks:
        avg[f"pass@{k}"] = sum(r[f"pass@{k}"] for r in rows) / len(rows)
        # independent benchmarks: Var(mean) = Σ se² / B²
        avg[f"pass@{k}_se"] = math.sqrt(sum(r[f"pass@{k}_se"] ** 2 for r in rows)) / len(rows)
    out["average"] = avg
    return out
