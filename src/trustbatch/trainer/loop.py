"""The RL loop: next batch → optimizer steps → weight sync → log, evaluate, checkpoint. One loop for every backend.

Read it top to bottom. It knows three parts and the hooks, never the configuration: the rollout
source (sync, async, a worker pool), the learner (one process or data parallel) and the weight sync
(shared module, copy, lag) are chosen once by ``trustbatch.recipes.build``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..pipeline.batch import TrainBatch
from ..pipeline.source import RolloutSource
from ..pipeline.weight_sync import WeightSync


class LearnerProtocol(Protocol):
    """What trains the policy: ``trainer.learner.Learner`` in this process (or data parallel), or learner ranks
    elsewhere. The loop uses ``version``, ``model`` and ``train_on``; the recipe's hooks the rest."""

    version: int  # optimizer steps taken: the policy version
    model: torch.nn.Module  # the policy this process holds, kept equal to the one trained
    step_records: list[dict[str, float]]  # the last round's per-optimizer-step metrics
    sharded: bool  # its forwards and weight gathers are collectives every rank must reach (FSDP2)
    on_step: list[Callable[[int, torch.nn.Module], None]]  # called (version, model) after every optimizer step
    # called (opt_step, epoch, minibatch, log_ratio) per optimizer step while not empty; None: it cannot report them
    on_step_ratios: list[Callable[[int, int, int, torch.Tensor], None]] | None

    def train_on(self, batch: TrainBatch) -> dict[str, float]:
        """The round's optimizer steps on ``batch``; advances ``version``; returns the round's metrics."""
        ...

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, C] float32 log-probs of the batch's completion tokens under the current policy."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


@dataclass
class Parts:
    source: RolloutSource
    learner: LearnerProtocol
    sync: WeightSync


class Hooks(Protocol):
    """What happens around the optimizer steps: logging, evaluation, checkpoints (``recipes.train``)."""

    def before_train(self, round_: int, batch: TrainBatch) -> None:
        """Sees the batch before the learner's update (e.g. the log-ratio histogram of the round)."""
        ...

    def after_round(self, round_: int, metrics: dict[str, float]) -> None:
        """Log, evaluate and checkpoint; ``metrics`` has ``skipped_step`` when no batch was trained on."""
        ...


def round_metrics(batch: TrainBatch, learner_metrics: dict, version_before: int, version_after: int,
                  step_s: float) -> dict[str, float]:
    """The learner's metrics plus the batch's, throughput, and versions and staleness from the samples' tags.

    ``staleness`` is the age, in optimizer steps, of the oldest policy-sampled row when the first
    optimizer step of the round used it; foreign rows (version −1) do not count.
    """
    versions = batch.behaviour_versions()
    oldest = int(versions.min()) if versions.numel() else version_before
    n_tok = float(batch.packed.response_mask.sum())
    m = dict(learner_metrics)
    m.update(batch.metrics)
    m.update(
        tokens_per_s=n_tok / step_s,
        step_s=step_s,
        policy_version=float(version_after),
        behaviour_version=float(oldest),
        staleness=float(version_before - oldest),
        staleness_mean=float(version_before - versions.double().mean()) if versions.numel() else 0.0,
    )
    return m


def run_loop(parts: Parts, hooks: Hooks, *, start_round: int, rounds: int) -> dict[str, float]:
    """Rounds ``start_round + 1 … rounds``. Returns the last trained round's metrics ({} if none)."""
    source, learner, sync = parts.source, parts.learner, parts.sync
    last: dict[str, float] = {}
    for round_ in range(start_round + 1, rounds + 1):
        t0 = time.time()
        # 1. rollouts, rewards, advantages, tagged with the policy version of every row
        batch = source.next_batch(learner.version)
        if batch is None:  # every group uninformative (DAPO dynamic sampling): nothing to train on
            hooks.after_round(round_, {**source.last_metrics, "skipped_step": 1.0})
            continue
        hooks.before_train(round_, batch)
        # 2. optimizer steps (epochs × minibatches); the learner advances the policy version
        version_before = learner.version
        learner_metrics = learner.train_on(batch)
        # 3. the behaviour policy follows the learner (or the learner of k steps ago)
        sync.push(learner.model, learner.version)
        source.on_update(learner_metrics)
        # 4. log, evaluate, checkpoint
        last = round_metrics(batch, learner_metrics, version_before, learner.version, time.time() - t0)
        hooks.after_round(round_, last)
    return last
