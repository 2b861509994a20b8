"""``weight_sync.BehaviourVersions``: the pushed weights an async batch in flight may carry, and its behaviour model.

Reference: copies of the model's state taken by the test at each version (``torch.equal``), and the staleness bound
written out (versions older than the newest − max_lag are dropped). The end-to-end check, the rebuilt log-probs
against the ones rollout workers recorded, is tests/integration/test_async_exact_kl.py.
"""

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.pipeline.weight_sync import BehaviourVersions
from trustbatch.policy.forward import pack

from llama_rows import _llama


class _Inner:
    """A transport's weight sync that records what it is pushed."""

    def __init__(self):
        self.pushed = []

    def push(self, model, version):
        self.pushed.append(version)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _batch(versions):
    packed = pack([[1, 2]] * len(versions), [[3, 4]] * len(versions), pad_id=0)
    return TrainBatch(packed, torch.zeros(len(versions), 2), torch.zeros(len(versions)),
                      torch.tensor(versions, dtype=torch.long))


def _step(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_keeps_the_versions_within_the_bound_and_names_each_batchs_behaviour():
    model = _llama(torch.float32)
    inner = _Inner()
    kept = BehaviourVersions(inner, model, version=0, max_lag=2, temperature=0.7)
    want = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    for v in range(1, 5):
        _step(model, v)
        want[v] = {k: t.clone() for k, t in model.state_dict().items()}
        kept.push(model, v)
    assert inner.pushed == [1, 2, 3, 4]
    assert sorted(kept.states) == [2, 3, 4]  # 4 − 2 = 2 is the oldest a trained-on batch can carry
    for v in (3, 2, 2, 4):
        batch = _batch([v, v])
        kept.attach(batch)
        (got_v, teacher), = batch.behaviour.items()
        assert got_v == v and teacher.temperature == 0.7 and teacher.autocast is None
        assert teacher.model is kept.frozen and teacher.model is not model
        assert not any(p.requires_grad for p in teacher.model.parameters())
        state = teacher.model.state_dict()
        assert all(torch.equal(state[k], want[v][k]) for k in want[v])
    assert all(t.device.type == "cpu" for s in kept.states.values() for t in s.values())
    with pytest.raises(ValueError, match=r"weights of policy version 1, which sampled this batch, are not kept"):
        kept.attach(_batch([1, 1]))
    with pytest.raises(ValueError, match=r"rows of policy versions \[3, 4\]"):
        kept.attach(_batch([3, 4]))


def test_a_resume_gets_the_in_flight_versions_back_from_the_snapshots():
    """After a resume the learner starts at the checkpoint's version; the source's snapshots (the older rounds'
    weights, which sample the next batches) are kept again (``BoundedSource.load_state_dict``)."""
    model = _llama(torch.float32)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, 1)
    kept = BehaviourVersions(_Inner(), model, version=5, max_lag=2, temperature=1.0)
    kept.keep(3, old)
    kept.keep(2, old)  # beyond the bound: no batch the learner trains on can carry it
    assert sorted(kept.states) == [3, 5]
    batch = _batch([3])
    kept.attach(batch)
    assert all(torch.equal(batch.behaviour[3].model.state_dict()[k], old[k]) for k in old)
