"""Verifiable-reward tasks from reasoning-gym (https://github.com/open-thought/reasoning-gym), generated offline.

A task is generated from a fixed seed, de-duplicated by prompt text, and split into disjoint
train and held-out prompts, so held-out accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import UserError


# Defaults per task, merged under the user's task.params. chain_sum: sums and differences of 2–3
# one-digit numbers, which a ~1M-parameter model partly learns from a minute of SFT.
DEFAULT_PARAMS: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
}


@dataclass(frozen=True)
class Example:
    """One prompt. ``reference`` is what the scorer compares against (for reasoning-gym, the entry as JSON)."""

    prompt: str
    reference: str
    answer: str  # the gold answer text, used as the SFT demonstration


@dataclass
class TaskSplit:
    name: str
    reward: str  # a scorer name for trustbatch.rewards.get
    train: list[Example] = field(default_factory=list)
    heldout: list[Example] = field(default_factory=list)


def load_task(name: str, *, train_size: int, heldout_size: int, seed: int, params: dict | None = None) -> TaskSplit:
    """Generate ``name`` from reasoning-gym and split it into disjoint train and held-out prompts.

    ``params`` are the task's own config fields (e.g. chain_sum: min_terms, max_terms, max_digits).
    The held-out prompts are the first ``heldout_size`` distinct prompts of the generated pool; the
    train prompts are distinct from them and from each other. If the task has fewer distinct
    prompts than asked for, train gets what is left (at least one).

    Raises:
        UserError: unknown task, bad params, or too few distinct prompts.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise UserError(f"unknown task {name!r}; choose a reasoning-gym task such as chain_sum, basic_arithmetic, leg_counting")
    if heldout_size < 1 or train_size < 1:
        raise UserError(f"task sizes must be >= 1 (train_size={train_size}, heldout_size={heldout_size})")
    pool = 2 * (train_size + heldout_size)
    try:
        ds = reasoning_gym.create_dataset(name, size=pool, seed=seed, **(params or {}))
    except (TypeError, AssertionError, ValueError) as e:
        raise UserError(f"invalid parameters {params} for task {name!r}: {e}") from None
    seen: set[str] = set()
    examples: list[Example] = []
    for entry in ds:
        q = entry["question"]
        if q in seen:
            continue
        seen.add(q)
        ref = json.dumps({"answer": entry["answer"], "metadata": entry.get("metadata", {})}, default=str)
        examples.append(Example(prompt=q, reference=ref, answer=str(entry["answer"])))
    if len(examples) < heldout_size + 1:
        raise UserError(
            f"task {name!r} with {params} gave only {len(examples)} distinct prompts; "
            f"lower task.heldout_size (now {heldout_size}) or widen the task parameters"
        )
    return TaskSplit(
        name=name,
        reward=f"rg:{name}",
        heldout=examples[:heldout_size],
        train=examples[heldout_size : heldout_size + train_size],
    )
