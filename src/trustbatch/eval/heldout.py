"""Held-out accuracy of a policy on a task's held-out prompts, with the same engine as training."""

from __future__ import annotations

from .. import rewards
from ..data import Example
from ..policy import Policy
from .passk import pass_at_k


def evaluate_heldout(policy: Policy, engine, examples: list[Example], scorer, *, samples_per_prompt: int,
                     temperature: float, max_new_tokens: int) -> dict[str, float]:
    """Score ``samples_per_prompt`` sampled completions and one greedy completion per held-out prompt.

    Returns ``heldout_accuracy`` (mean reward of the samples: the pass@1 estimate at ``temperature``,
    the paper's protocol at T = 1), ``heldout_pass@{n}`` (unbiased, reward > 0 counts as correct),
    ``heldout_greedy_accuracy`` and ``heldout_reward_errors``.
    """
    prompts = [policy.encode_prompt(e.prompt) for e in examples]
    n = samples_per_prompt
    ro = engine.generate(prompts, n, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    r, err = rewards.score_all(scorer, [policy.decode(x.completion_ids) for x in ro],
                               [examples[x.prompt_index].reference for x in ro])
    greedy = engine.generate(prompts, 1, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, greedy=True)
    g, err2 = rewards.score_all(scorer, [policy.decode(x.completion_ids) for x in greedy],
                                [examples[x.prompt_index].reference for x in greedy])
    correct = [sum(1 for v in r[i * n:(i + 1) * n] if v > 0) for i in range(len(examples))]
    return {
        "heldout_accuracy": sum(r) / len(r),
        f"heldout_pass@{n}": sum(pass_at_k(n, c, n) for c in correct) / len(correct),
        "heldout_greedy_accuracy": sum(g) / len(g),
        "heldout_reward_errors": float(err + err2),
    }
