"""Async rollout workers on an engine that declares ``top_k`` (vLLM) send its top-k log-probs with each batch.

Without vLLM: a stand-in engine returns rollouts with per-token top-k fields, as ``VLLMEngine`` does when asked to
record. The worker is the real ``RolloutWorker`` (its ``SyncSource``) built from the ``WorkerSpec`` the async backend
makes (``backends._worker_spec``); its batch goes through a pickle round trip (what a process worker sends) and the
real ``BoundedSource``. Reference: each rollout's own top-k tensors, right-aligned by hand into [B, C, k].
The real run (vLLM in a worker process, the learner's logged bound) is tests/integration/test_vllm_train.py.
"""

import dataclasses
import pickle
from types import SimpleNamespace

import torch

from trustbatch.data.tasks import Example
from trustbatch.orchestration.rollout_worker import RolloutWorker
from trustbatch.pipeline.async_source import BoundedSource
from trustbatch.pipeline.source import SourceSpec
from trustbatch.policy.forward import TopK
from trustbatch.recipes import backends
from trustbatch.rewards.spec import RewardSpec
from trustbatch.rollout.engine import Rollout, SamplingParams
from trustbatch.rollout.spec import EngineSpec

K, VERSION = 3, 7


class _TopKEngine:
    """Rollouts of 1..3 tokens with random top-k log-probs and ids, like a recording vLLM engine."""

    version = VERSION

    def __init__(self):
        self.made: list[Rollout] = []

    def generate(self, prompts, n, sampling, seeds=None):
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                g = torch.Generator().manual_seed(100 * i + j)
                L = 1 + (i + j) % 3
                out.append(Rollout(i, list(p), [5 + x for x in range(L)], [-0.5] * L, False, self.version,
                                   behavior_top_logprobs=-torch.rand(L, K, generator=g),
                                   behavior_top_ids=torch.randint(0, 50, (L, K), generator=g)))
        self.made += out
        return out

    def teacher(self, sampling):
        return TopK(K)

    def load_weights(self, weights, version):
        self.version = version


class _Transport:
    """One finished batch, pickled as ``process_rollout`` sends it; nothing else."""

    n, ahead = 1, 0

    def __init__(self, payload):
        self.payload = payload

    def start(self, first):
        pass

    def request(self, b, k):
        pass

    def poll(self, timeout_s):
        payload, self.payload = self.payload, None
        return None if payload is None else ("batch", 0, 0, pickle.loads(payload))

    def close(self):
        pass


def _inputs(engine: EngineSpec):
    train = [Example(prompt=f"{i} + 1 =", reference=str(i + 1), answer=str(i + 1)) for i in range(4)]
    spec = SourceSpec(SamplingParams(max_new_tokens=3), group_size=2, prompts_per_step=3, seed=0,
                      behaviour_models=True)  # kl=exact asks for the behaviour distribution
    return backends.Inputs(cfg=SimpleNamespace(rollout=SimpleNamespace(staleness=0, foreign_fraction=0.0),
                                                  train=SimpleNamespace(precision="float32")),
                           task=SimpleNamespace(train=train, long_prompts=None),
                           policy=SimpleNamespace(encode_prompt=lambda text: [1, 2, len(text)]), pool=None,
                           world=SimpleNamespace(size=1), version=VERSION, engine=engine, source=spec,
                           reward=RewardSpec("math", workers=0), whole=None)


def test_worker_batches_carry_top_k_log_probs_mapped_to_top_k(monkeypatch):
    inp = _inputs(EngineSpec(name="vllm", record=True, top_k=K))
    spec = backends._worker_spec(inp)
    assert spec.source.behaviour_models  # the worker's batch maps its version to its engine's teacher
    engine = _TopKEngine()
    monkeypatch.setattr("trustbatch.policy.load_policy", lambda d: SimpleNamespace(decode=str, pad_id=0))
    monkeypatch.setattr("trustbatch.rollout.spec.make_engine", lambda *a, **kw: engine)
    worker = RolloutWorker(dataclasses.replace(spec, model_dir="unused"))
    made = worker.make_batch(0)
    worker.close()

    source = BoundedSource(_Transport(pickle.dumps(made)), max_staleness=1)
    assert backends._exact_behaviour(inp, source) is source.sync and source.behaviour is None  # nothing rebuilt
    batch = source.next_batch(learner_version=VERSION)
    B, C = batch.packed.response_mask.shape
    assert B == 6 and batch.behaviour == {VERSION: TopK(K)} and batch.behavior_logprobs_full is None
    assert batch.behavior_top_logprobs.shape == batch.behavior_top_ids.shape == (B, C, K)
    assert batch.behavior_top_ids.dtype == torch.long
    want_lp, want_ids = torch.zeros(B, C, K), torch.zeros(B, C, K, dtype=torch.long)
    for i, r in enumerate(engine.made):  # one group per prompt, in the order sampled
        L = len(r.completion_ids)
        want_lp[i, C - L:], want_ids[i, C - L:] = r.behavior_top_logprobs, r.behavior_top_ids
    assert torch.equal(batch.behavior_top_logprobs, want_lp) and torch.equal(batch.behavior_top_ids, want_ids)


def test_workers_of_a_full_engine_send_nothing_and_the_learner_rebuilds():
    spec = backends._worker_spec(_inputs(EngineSpec(name="transformers", record=True)))
    assert not spec.source.behaviour_models
    assert not backends.workers_send(EngineSpec(name="transformers", precision="bfloat16"))  # recorded: not sent
