"""Sample n completions per prompt with a rollout engine and score them: the common core of every evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ..data import Example
from ..rewards import COMPLETION_IDS_KEY, GROUP_KEY, STATE_KEY, ScoreResult, merge_logged
from ..rollout.engine import SamplingParams
from .passk import pass_at_k


SOLVED = 1 - 1e-6  # the full reward, up to the round-off of a weighted sum of reward functions


@dataclass
class Scored:
    """Per-prompt results of ``sample_and_score``."""

    n: int  # samples per prompt
    correct: list[int]  # per prompt: samples with the full reward (``SOLVED``)
    reward_mean: float  # mean reward over all samples
    reward_errors: int
    reward_timeouts: int
    response_tokens: float  # mean completion length
    truncated_fraction: float
    reward_se: float = math.nan  # standard error over prompts of the per-prompt mean reward (NaN when P = 1)
    samples: list[dict] = field(default_factory=list)  # ``keep_samples`` of them (``sample_and_score``)
    logged: dict[str, list[float]] = field(default_factory=dict)  # reward functions' log_metric values, by name

    def pass_at(self, k: int) -> tuple[float, float]:
        """(mean over prompts of the unbiased pass@k, its standard error over prompts).

        The standard error is the sample standard deviation of the per-prompt pass@k divided by
        √P; it measures the spread over prompts (the benchmark's finite size), the dominant term
        when n ≫ k. NaN when P = 1.
        """
        vals = [pass_at_k(self.n, c, k) for c in self.correct]
        return sum(vals) / len(vals), _standard_error(vals)


def sample_and_score(policy, engine, examples: list[Example], pool, *, n: int, temperature: float,
                     max_new_tokens: int, greedy: bool = False, chunk_prompts: int = 64,
                     on_progress: Callable[[int], None] | None = None,
                     check: Callable[[ScoreResult, int], None] | None = None,
                     max_failure_rate: float | None = None, keep_samples: int = 0,
                     state: dict | None = None) -> Scored:
    """Generate ``n`` completions per example (greedy: one) and score them with ``pool`` (a RewardPool).

    A sample counts as correct when it gets the full reward (≥ ``SOLVED``): a partial-credit scorer's share is
    not a solved prompt (reasoning-gym's ``chain_sum`` gives 0.5 to ``18`` and ``-8`` for the answer 8, 0.2 to
    ``81110``, 0.8 to ``12345`` for 1234; it counted as solved at the earlier threshold 0.5).
    ``on_progress(prompts_done)`` is called after each chunk of ``chunk_prompts`` prompts.

    ``check(result, n)`` judges each chunk's scoring as a rollout round's is judged (``recipes.build.scoring_check``:
    a warning on any failure, a UserError past ``reward.max_failure_rate``); with ``max_failure_rate`` (the
    check's rate) the pool stops scoring a chunk as soon as the check's refusal is certain.
    ``keep_samples``: ``Scored.samples`` holds the first sample of each of the first ``keep_samples`` prompts
    (``{"prompt", "completion", "reward", "reference", "behaviour_logprob_sum"}``: the example's reference answer and
    the sum over the completion's tokens of the log-prob the engine sampled each with), the same prompts at every
    call, so a run's samples can be read side by side across evaluations, with the columns reward functions logged
    for them (TRL's ``log_extra``: ``with_extras``); ``Scored.logged`` holds their ``log_metric`` values.
    ``state``: a ``rewards.TrainerState``'s fields (``rewards.round_state``), passed to a reward function that takes
    ``trainer_state``; None (``trustbatch eval``, outside training) passes none.

    Raises:
        UserError: from ``check``.
        RuntimeError: a chunk stopped early (``max_failure_rate``) and ``check`` let it pass (a caller's bug:
            the two rates differ).
    """
    n = 1 if greedy else n
    sampling = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, greedy=greedy)
    correct: list[int] = []
    kept: list[tuple[dict, dict]] = []  # (sample row, its log_extra columns)
    logged: dict[str, list[float]] = {}
    prompt_means: list[float] = []
    total, tokens, truncated, errors, timeouts = 0.0, 0, 0, 0, 0
    for s in range(0, len(examples), chunk_prompts):
        part = examples[s:s + chunk_prompts]
        ro = engine.generate([policy.encode_prompt(e.prompt) for e in part], n, sampling)
        completions = [policy.decode(x.completion_ids) for x in ro]
        res = _score_chunk(pool, part, ro, completions, state, check, max_failure_rate)
        errors, timeouts = errors + res.errors, timeouts + res.timeouts
        total += sum(res.rewards)
        tokens += sum(len(x.completion_ids) for x in ro)
        truncated += sum(x.truncated for x in ro)
        kept += [(sample_row(part[i].prompt, completions[i * n], res.rewards[i * n], part[i].reference,
                             sum(ro[i * n].behavior_logprobs)), {c: v[i * n] for c, v in res.extra.items() if i * n in v})
                 for i in range(min(len(part), keep_samples - len(kept)))]
        logged = merge_logged([logged, res.logged])
        for i in range(len(part)):
            correct.append(sum(1 for v in res.rewards[i * n:(i + 1) * n] if v >= SOLVED))
            prompt_means.append(sum(res.rewards[i * n:(i + 1) * n]) / n)
        if on_progress is not None:
            on_progress(min(s + chunk_prompts, len(examples)))
    m = n * len(examples)
    return Scored(n=n, correct=correct, reward_mean=total / m, reward_errors=errors, reward_timeouts=timeouts,
                  response_tokens=tokens / m, truncated_fraction=truncated / m, reward_se=_standard_error(prompt_means),
                  samples=with_extras([row for row, _ in kept], [e for _, e in kept]), logged=logged)


def _score_chunk(pool, part: list[Example], ro: list, completions: list[str], state: dict | None, check,
                 max_failure_rate: float | None) -> ScoreResult:
    """``pool``'s scoring of one chunk's rollouts ``ro`` of the examples ``part``, judged by ``check``
    (``sample_and_score``'s arguments)."""
    stop = {} if max_failure_rate is None else {"max_failure_rate": max_failure_rate}
    res = pool.score(completions, [part[x.prompt_index].reference for x in ro],
                     contexts=[{**part[x.prompt_index].context(), GROUP_KEY: x.prompt_index,
                                COMPLETION_IDS_KEY: x.completion_ids, **({} if state is None else {STATE_KEY: state})}
                               for x in ro], **stop)
    if check is not None:
        check(res, len(res.rewards))
    if res.unscored:
        raise RuntimeError(f"{res.unscored} completions were left unscored at max_failure_rate={max_failure_rate} "
                           "but the check passed them; give check and max_failure_rate the same rate")
    return res


def sample_row(prompt: str, completion: str, reward: float, reference, logprob_sum: float) -> dict:
    """One sample completion as ``samples.jsonl`` and the trackers show it (``log.samples``): ``reference`` is the
    example's answer as the task stores it; ``logprob_sum`` the completion's log-probability under the distribution
    it was sampled from (nats, the sum of its tokens' behaviour log-probs)."""
    return {"prompt": prompt, "completion": completion, "reward": float(reward), "reference": reference,
            "behaviour_logprob_sum": float(logprob_sum)}


RECORD_KEYS = ("round", "split", "step")  # what ``samples.jsonl`` adds to a sample row, and its older name of round


def with_extras(rows: list[dict], extras: list[dict]) -> list[dict]:
    """``sample_row``s with the columns reward functions logged for them (``extras[i]``: row i's, TRL's
    ``log_extra``) after their own: every row gets every column that any of them has, in first-seen order (None
    where a row has none; a tracker's table takes its columns from the first row), and a column named as one of the
    row's own keys or of its record's (``RECORD_KEYS``: a resume cuts ``samples.jsonl`` back by its rounds) is left
    out (the row's value stands)."""
    own = set(rows[0] if rows else ()) | set(RECORD_KEYS)
    columns = list(dict.fromkeys(c for e in extras for c in e if c not in own))
    return [{**row, **{c: e.get(c) for c in columns}} for row, e in zip(rows, extras)]


def _standard_error(xs: list[float]) -> float:
    """Sample standard deviation of ``xs`` over √len(xs): the spread over prompts; NaN for fewer than 2."""
    if len(xs) < 2:
        return math.nan
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
