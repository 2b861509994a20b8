"""Held-out accuracy during training, with the same engine and reward pool as the rollouts."""

from __future__ import annotations

from ..data import Example
from ..policy import Policy
from .sampling import sample_and_score


def evaluate_heldout(policy: Policy, engine, examples: list[Example], pool, *, samples_per_prompt: int,
                     temperature: float, max_new_tokens: int, check=None,
                     max_failure_rate: float | None = None, keep_samples: int = 0, state: dict | None = None) -> dict:
    """Score ``samples_per_prompt`` sampled completions and one greedy completion per held-out prompt.

    Returns ``heldout_accuracy`` (mean reward of the samples at ``temperature``, the paper's protocol at T = 1: the
    pass@1 estimate for a 0/1 scorer; above the share of solved samples for a partial-credit one, such as the
    default reasoning-gym task's, which ``heldout_pass@{n}`` counts (``sampling.SOLVED``)),
    ``heldout_accuracy_se`` (its standard error over prompts: the sample
    standard deviation of the per-prompt mean rewards over √P; NaN for one prompt), ``heldout_pass@{n}`` (unbiased estimator, Chen et al. 2021),
    ``heldout_greedy_accuracy``, ``heldout_reward_errors`` and ``heldout_reward_timeouts``.
    ``check`` and ``max_failure_rate`` judge each scoring call as a rollout round's (``sample_and_score``).
    With ``keep_samples`` > 0 the dict also holds ``samples``: the first sampled completion of each of the first
    ``keep_samples`` prompts (the same prompts at every call), as ``sampling.sample_row`` makes them. ``state``: where
    training stands, for a reward function's ``trainer_state`` (``sample_and_score``); what reward functions log
    through ``log_metric`` on the sampled completions is ``heldout_reward_metrics/NAME`` (its mean over calls).

    Raises:
        UserError: from ``check`` (the scorer failed on more than ``reward.max_failure_rate`` of a call).
    """
    n = samples_per_prompt
    rule = dict(check=check, max_failure_rate=max_failure_rate, state=state)
    s = sample_and_score(policy, engine, examples, pool, n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                         chunk_prompts=max(1, 512 // n), keep_samples=keep_samples, **rule)
    g = sample_and_score(policy, engine, examples, pool, n=1, temperature=1.0, max_new_tokens=max_new_tokens,
                         greedy=True, chunk_prompts=512, **rule)
    out = {
        "heldout_accuracy": s.reward_mean,
        "heldout_accuracy_se": s.reward_se,
        f"heldout_pass@{n}": s.pass_at(n)[0],
        "heldout_greedy_accuracy": g.reward_mean,
        "heldout_reward_errors": float(s.reward_errors + g.reward_errors),
        "heldout_reward_timeouts": float(s.reward_timeouts + g.reward_timeouts),
    }
    out.update({f"heldout_reward_metrics/{name}": sum(v) / len(v) for name, v in s.logged.items()})
    if keep_samples > 0:
        out["samples"] = s.samples
    return out
