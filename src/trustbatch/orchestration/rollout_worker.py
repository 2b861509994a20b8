"""A rollout worker: an engine, a reward pool and a batch maker, in a process of its own (or a Ray actor).

Everything it receives is plain data (``WorkerSpec``) or named tensors; everything it returns is a
``TrainBatch`` of tensors tagged with the policy version that produced it. The batch maker is the sync
source's own ``make_batch``, so batch ``b`` is the same whichever worker makes it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass

import torch

from ..data.tasks import LongPrompts
from ..pipeline.source import SourceSpec, SyncSource
from ..rewards.spec import RewardSpec
from ..rollout.spec import EngineSpec
from ..seeding import row_seed


@dataclass
class WorkerSpec:
    """What a rollout worker needs, as plain values (picklable, no modules): the run's own specs.

    model_dir: a local HF directory with the policy's architecture and tokenizer (weights arrive through
    ``load_weights``). prompts, references: the training prompts' token ids and gold answers. engine, source,
    reward: the specs the trainer built from its config (``recipes.build``). threads: the worker's torch threads
    (its engine's too). contexts: per prompt, for batch-form reward functions (``SyncSource``). long_prompts: what
    ``data.max_prompt_tokens`` did to the prompts, for the round's metrics (``SyncSource``). autocast: the learner's
    autocast dtype by name (``"bfloat16"`` under bf16-mixed), which an engine computing as the learner does (a
    float32 transformers engine) samples under; None: none.
    """

    model_dir: str
    prompts: list[list[int]]
    references: list
    engine: EngineSpec
    source: SourceSpec
    reward: RewardSpec
    threads: int = 1
    contexts: list | None = None
    long_prompts: LongPrompts | None = None
    autocast: str | None = None


def for_start(spec: WorkerSpec, start: int) -> WorkerSpec:
    """``spec`` for the ``start``-th worker process or actor this source starts (0-based, restarts counted): its
    engine gets a random stream of its own, ``row_seed(seed, start)`` cut to 32 bits (vLLM's range). vLLM samples from its engine's seed alone
    (per-request seeds fail in its CPU sampler), so every worker replayed one stream: two workers' n-th batches of
    the same prompts and weights were copies. The first start keeps the run's seed (one worker: as before). The
    transformers engine samples from each batch's own seeds and is unchanged."""
    if start == 0:
        return spec
    seed = row_seed(spec.engine.seed, start) % 2**32
    return dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, seed=seed))


class RolloutWorker:
    """Builds its own policy copy, engine and reward pool from a ``WorkerSpec``; makes batches on demand."""

    def __init__(self, spec: WorkerSpec):
        from ..policy import load_policy
        from ..rollout.spec import make_engine

        torch.set_num_threads(spec.threads)
        self.spec = spec
        policy = load_policy(spec.model_dir)
        self.engine = make_engine(dataclasses.replace(spec.engine, threads=spec.threads), policy,
                                  model_dir=spec.model_dir,
                                  autocast=getattr(torch, spec.autocast) if spec.autocast else None)
        self.pool = spec.reward.pool()
        # a broken scorer stops the run from the learner's side, with its message
        check = spec.reward.check(where="a rollout worker's batch")
        self.source = SyncSource(self.engine, spec.prompts, spec.references, self.pool, policy.decode, spec.source,
                                 pad_id=policy.pad_id, check_round=check, contexts=spec.contexts,
                                 long_prompts=spec.long_prompts)

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, weights, version: int) -> None:
        """Named float tensors of the learner's policy ``version`` (see ``Engine.load_weights``)."""
        self.engine.load_weights(weights, version)

    def make_batch(self, b: int):
        """``(batch or None, rollout metrics)`` for batch number ``b``; rows tagged with this worker's version."""
        batch = self.source.make_batch(b)
        return batch, dict(self.source.last_metrics)

    def close(self) -> None:
        self.pool.close()


def save_worker_model(spec: WorkerSpec, policy) -> str:
    """Write ``policy`` (architecture, tokenizer, current weights) to a new temporary HF directory and
    point ``spec.model_dir`` at it. Returns the directory; the caller removes it."""
    model_dir = tempfile.mkdtemp(prefix="trustbatch-rollout-model-")
    policy.save(model_dir)
    spec.model_dir = model_dir
    return model_dir
