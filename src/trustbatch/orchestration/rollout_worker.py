"""A rollout worker: an engine, a reward pool and a batch maker, in a process of its own (or a Ray actor).

Everything it receives is plain data (``WorkerSpec``) or named tensors; everything it returns is a
``TrainBatch`` of tensors tagged with the policy version that produced it. The batch maker is the sync
source's own ``make_batch``, so batch ``b`` is the same whichever worker makes it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import torch

from ..pipeline.source import SyncSource
from ..rollout.engine import SamplingParams


@dataclass
class WorkerSpec:
    """What a rollout worker needs, as plain values (picklable, no modules).

    model_dir: a local HF directory with the policy's architecture and tokenizer (weights arrive
    through ``load_weights``); the rest mirrors ``SyncSource``'s arguments.
    """

    model_dir: str
    prompts: list[list[int]]
    references: list
    reward: str | tuple  # a scorer name, or (name, weight) terms (``rewards.make_reward``)
    sampling: SamplingParams
    group_size: int
    prompts_per_step: int
    seed: int
    precision: str = "float32"
    reward_workers: int = 0
    reward_timeout_s: float = 10.0
    max_failure_rate: float = 1.0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    overlong_cache: int | None = None
    advantage: str = "zscore"
    std: str = "population"
    threads: int = 1
    engine: str = "transformers"  # or "vllm" (its own vllm.LLM in the worker's process)
    quantization: str | None = None  # vllm engine only
    extra: dict = field(default_factory=dict)
    contexts: list | None = None  # per prompt, for batch-form reward functions (``SyncSource``)


class RolloutWorker:
    """Builds its own policy copy, engine and reward pool from a ``WorkerSpec``; makes batches on demand."""

    def __init__(self, spec: WorkerSpec):
        from .. import rewards
        from ..policy import load_policy
        from ..rollout import TransformersEngine

        torch.set_num_threads(spec.threads)
        self.spec = spec
        policy = load_policy(spec.model_dir)
        if spec.engine == "vllm":
            from ..rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(spec.model_dir, policy.eos_id, policy.pad_id, precision=spec.precision,
                                     quantization=spec.quantization, seed=spec.seed, threads=spec.threads,
                                     max_model_len=getattr(policy.model.config, "max_position_embeddings", None))
        else:
            self.engine = TransformersEngine(policy.model, policy.eos_id, policy.pad_id, precision=spec.precision,
                                             share=spec.precision == "float32")
        self.pool = rewards.make_reward(spec.reward, workers=spec.reward_workers, timeout_s=spec.reward_timeout_s)
        scorer = spec.reward if isinstance(spec.reward, str) else rewards.WeightedRewards.describe(spec.reward)

        def check(result, n):  # a broken scorer stops the run from the learner's side, with its message
            rewards.check_scoring(result, n=n, scorer=scorer, max_failure_rate=spec.max_failure_rate,
                                  where="a rollout worker's batch")

        self.source = SyncSource(
            self.engine, spec.prompts, spec.references, self.pool, policy.decode, sampling=spec.sampling,
            group_size=spec.group_size, prompts_per_step=spec.prompts_per_step, pad_id=policy.pad_id,
            seed=spec.seed, dynamic_sampling=spec.dynamic_sampling, max_sampling_rounds=spec.max_sampling_rounds,
            overlong_cache=spec.overlong_cache, advantage=spec.advantage, std=spec.std, check_round=check,
            contexts=spec.contexts)

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
