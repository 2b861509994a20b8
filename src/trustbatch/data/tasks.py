"""Verifiable-reward tasks from reasoning-gym (https://github.com/open-thought/reasoning-gym), generated offline.

A task is generated from a fixed seed, de-duplicated by prompt text, and split into disjoint
train and held-out prompts, so held-out accuracy measures generalisation, not recall.

``chain_sum_steps`` is reasoning-gym's ``chain_sum`` with worked demonstrations: the completion states
every partial sum, ``"4-1=3, 3-7=-4, -4+7=3, answer 3"`` (25–31 tokens with the default base's tokenizer,
EOS included, for four one-digit terms), so that a train–inference mismatch can build up over a sequence
instead of over the ~3 tokens of a bare answer. Its reward (``rg-final:chain_sum``) scores only the number
after the last ``answer``, with the task's own ``score_answer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..rewards.scorers import entry_reference


# Defaults per task, merged under the user's task.params. chain_sum: sums and differences of 2–3
# one-digit numbers, which a ~1M-parameter model partly learns from a minute of SFT.
DEFAULT_PARAMS: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    # four terms: three worked steps, 25–31 completion tokens
    "chain_sum_steps": {"min_terms": 4, "max_terms": 4, "min_digits": 1, "max_digits": 1},
}
# Config defaults a task needs to fit, applied when the key is not set explicitly (config.Config):
# the longest chain_sum_steps demonstration is 31 tokens; 40 leaves room to be wrong at length, and
# the longest prompt (23 tokens) + 40 fits the default base's 64 positions.
TASK_DEFAULTS: dict[str, dict] = {"chain_sum_steps": {"rollout.max_new_tokens": 40}}
# trustbatch task with worked demonstrations -> the reasoning-gym task it states (only chain_sum has a writer)
STEPS_TASKS = {"chain_sum_steps": "chain_sum"}


def chain_sum_steps(expression: str) -> str:
    """The worked demonstration of a chain_sum expression: each partial sum, then ``answer N``.

    ``"4 - 1 - 7 + 7"`` → ``"4-1=3, 3-7=-4, -4+7=3, answer 3"``.

    Raises:
        ValueError: the expression is not ``int (+|- int)*`` separated by spaces.
    """
    toks = expression.split()
    if len(toks) % 2 == 0 or any(op not in "+-" for op in toks[1::2]):
        raise ValueError(f"not a chain_sum expression: {expression!r}")
    acc, steps = int(toks[0]), []
    for op, c in zip(toks[1::2], toks[2::2]):
        new = acc + int(c) if op == "+" else acc - int(c)
        steps.append(f"{acc}{op}{c}={new}")
        acc = new
    return ", ".join(steps + [f"answer {acc}"])


@dataclass(frozen=True)
class Example:
    """One prompt. ``reference`` is what the scorer compares against (for reasoning-gym, the entry as JSON).

    ``columns``: every field of the data row it came from (empty for generated tasks), which a batch-form reward
    function receives by name (``rewards.scorers.BatchForm``).
    """

    prompt: str
    reference: str
    answer: str  # the SFT demonstration: the gold answer text, or worked steps ending in it (STEPS_TASKS)
    columns: dict = field(default_factory=dict, compare=False, hash=False)
    # the format's own prompt (question and instruction) of a row whose prompt column took its place, else "": a
    # held-out row is kept out of training by either text
    question: str = field(default="", compare=False, hash=False)

    @property
    def keys(self) -> set[str]:
        """The texts that make this example the same prompt as another: its prompt, and its ``question``."""
        return {self.prompt, self.question} - {""}

    def context(self) -> dict:
        """What a batch-form reward function is told about this prompt: its text and its data row's fields."""
        return {**self.columns, "prompt": self.prompt}


@dataclass(frozen=True)
class LongPrompts:
    """What ``data.max_prompt_tokens`` did to the training prompts at start: ``truncated`` holds the indices (into the
    train split as trained on) of those left-truncated, ``skipped`` counts those dropped for their length (the limit
    or the model's context)."""

    truncated: frozenset[int] = frozenset()
    skipped: int = 0

    def metrics(self, drawn: list[int]) -> dict[str, float]:
        """A round's ``prompts_truncated`` (of the train prompt indices ``drawn``, refills included, those
        truncated) and the run's ``prompts_skipped``."""
        return {"prompts_truncated": float(sum(i in self.truncated for i in drawn)),
                "prompts_skipped": float(self.skipped)}


@dataclass
class TaskSplit:
    name: str
    reward: str  # a scorer name for trustbatch.rewards.get
    train: list[Example] = field(default_factory=list)
    heldout: list[Example] = field(default_factory=list)
    # the held-out file's own scorer, where one was given (data.heldout in another format than data.train)
    heldout_reward: str | None = None
    long_prompts: LongPrompts | None = None  # with data.max_prompt_tokens (recipes.build.prepare_run)


def load_task(name: str, *, train_size: int, heldout_size: int, seed: int, params: dict | None = None) -> TaskSplit:
    """Generate ``name`` from reasoning-gym and split it into disjoint train and held-out prompts.

    ``params`` are the task's own config fields (e.g. chain_sum: min_terms, max_terms, max_digits).
    The held-out prompts are the first ``heldout_size`` distinct prompts of the generated pool; the
    train prompts are distinct from them and from each other. If the task has fewer distinct
    prompts than asked for, train gets what is left (at least one).

    Raises:
        UserError: unknown task, bad params, or too few distinct prompts.
    """
    from ..rewards.scorers import import_reasoning_gym

    reasoning_gym, DATASETS = import_reasoning_gym()
    steps_of = STEPS_TASKS.get(name)
    rg_name = steps_of or name
    if rg_name not in DATASETS:
        raise UserError(f"unknown task {name!r}; choose a reasoning-gym task such as chain_sum, basic_arithmetic, leg_counting, "
                        f"or {', '.join(sorted(STEPS_TASKS))} (worked steps)")
    if heldout_size < 1 or train_size < 1:
        raise UserError(f"task sizes must be >= 1 (train_size={train_size}, heldout_size={heldout_size})")
    pool = 2 * (train_size + heldout_size)
    try:
        ds = reasoning_gym.create_dataset(rg_name, size=pool, seed=seed, **(params or {}))
    except (TypeError, AssertionError, ValueError) as e:
        raise UserError(f"invalid parameters {params} for task {name!r}: {e}") from None
    seen: set[str] = set()
    examples: list[Example] = []
    for entry in ds:
        q = entry["question"]
        if q in seen:
            continue
        seen.add(q)
        ref = entry_reference(entry)
        demo = chain_sum_steps(entry["metadata"]["expression"]) if steps_of else str(entry["answer"])
        examples.append(Example(prompt=q, reference=ref, answer=demo))
    if len(examples) < heldout_size + 1:
        raise UserError(
            f"task {name!r} with {params} gave only {len(examples)} distinct prompts; "
            f"lower task.heldout_size (now {heldout_size}) or widen the task parameters"
        )
    return TaskSplit(
        name=name,
        reward=f"rg-final:{steps_of}" if steps_of else f"rg:{name}",
        heldout=examples[:heldout_size],
        train=examples[heldout_size : heldout_size + train_size],
    )
