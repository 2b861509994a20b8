"""What TRL's ``GRPOTrainer`` passes every reward function beside the batch: ``trainer_state`` (where training
stands, for a reward that changes with it), ``log_metric`` and ``log_extra`` (what the function logs).

A batch-form reward function (``scorers.BatchForm``) gets each of them it takes, by name or ``**kwargs``, as TRL
passes them (TRL 1.x ``GRPOTrainer._calculate_rewards``). The function may run in a reward worker process
(``reward.workers``): what it logs comes back with its scores (``ScoreResult.logged``, ``ScoreResult.extra``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# In a completion's context: where training stands (``TrainerState``'s fields as a dict), set by the rollout source
# and held-out evaluation; never passed to a reward function as a column.
STATE_KEY = "_trustbatch_trainer_state"

PASSED = ("trainer_state", "log_metric", "log_extra")


@dataclass(frozen=True)
class TrainerState:
    """The ``trainer_state`` a reward function gets: the fields of ``transformers.TrainerState`` (what TRL passes)
    that a round knows, under their names.

    ``global_step``: optimizer steps taken by the policy that sampled the completions (its policy version: the
    learner's in sync rollout; a few fewer in async rollout, by the batch's staleness). ``max_steps``: the run's
    optimizer steps (``train.steps × train.epochs × train.minibatches``). ``epoch``: passes over the training
    prompts drawn before this round, batches × ``rollout.prompts_per_step`` / training prompts (a float, as TRL's
    ``state.epoch``; a dynamic-sampling refill's draws are not counted). Another attribute of transformers' class
    raises AttributeError, which fails the call (counted as the function's error, its message naming the attribute).
    """

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


def round_state(global_step: int, max_steps: int, batches: int, prompts_per_step: int, prompts: int) -> dict:
    """A ``TrainerState``'s fields as a dict (a completion context's ``STATE_KEY``): ``batches`` of
    ``prompts_per_step`` drawn before, out of ``prompts`` training prompts, give ``epoch``."""
    return {"global_step": int(global_step), "max_steps": int(max_steps),
            "epoch": batches * prompts_per_step / max(1, prompts)}


class RewardLogs:
    """``log_metric`` and ``log_extra`` for one call of a reward function on ``n`` completions (one group).

    ``log_metric(name, value)``: a scalar for the call; a round logs each name's mean over its calls as
    ``reward_metrics/NAME`` (TRL averages a name's values over a logging step and logs it as ``NAME``; the prefix
    keeps it from overwriting one of trustbatch's own metrics). ``log_extra(column, values)``: one value per
    completion of the call, a column of the run's sample completions (``log.samples``, TRL's completions table).
    A bad argument raises ValueError, which fails the call with that message.
    """

    def __init__(self, n: int):
        self.n = n
        self.metrics: list[tuple[str, float]] = []
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric(name, value) got name {name!r}; give a non-empty string")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"log_metric({name!r}, value) got {type(value).__name__} {value!r:.60}; give a number") \
                from None
        if not math.isfinite(v):
            raise ValueError(f"log_metric({name!r}, value) got {v}; give a finite number")
        self.metrics.append((name, v))

    def log_extra(self, column: str, values) -> None:
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra(column, values) got column {column!r}; give a non-empty string")
        values = list(values)
        if len(values) != self.n:
            raise ValueError(f"log_extra({column!r}, values) got {len(values)} values for {self.n} completions; give "
                             "one per completion of the call")
        self.extra[column] = [_cell(v) for v in values]

    def kwargs(self, takes: set[str], state: dict | None) -> dict:
        """The keyword arguments of ``PASSED`` a function that takes ``takes`` of them gets (``state``: the
        completions' ``STATE_KEY``, or None where the caller gave none: then no ``trainer_state``)."""
        out = {"log_metric": self.log_metric, "log_extra": self.log_extra}
        if state is not None:
            out["trainer_state"] = TrainerState(**state)
        return {k: v for k, v in out.items() if k in takes}

    def result(self) -> tuple[list[tuple[str, float]], dict[str, list]] | None:
        """What the call logged (picklable, for a reward worker's answer), or None when nothing."""
        return (self.metrics, self.extra) if self.metrics or self.extra else None


def _cell(v):
    """A ``log_extra`` value as ``samples.jsonl`` can hold it: a JSON value as it is (a non-finite float as text), a
    NumPy or torch scalar as its number, anything else as its text."""
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    item = getattr(v, "item", None)
    if callable(item):  # a NumPy or torch scalar
        try:
            x = item()
        except (TypeError, ValueError, RuntimeError):
            return str(v)
        return _cell(x) if isinstance(x, (bool, int, float)) else str(v)
    try:
        json.dumps(v, allow_nan=False)
        return v
    except (TypeError, ValueError):
        return str(v)
