"""``rollout.mode=async`` with ``objective.options={kl: exact}``: the learner rebuilds each batch's stale behaviour policy.

Rollout worker processes sample with the weights the learner pushed; the learner keeps those weights by version
(``pipeline.weight_sync.BehaviourVersions``) and teacher-forces the version each batch records. Reference: the
behaviour log-probs the worker recorded at its sampled tokens while decoding (its engine's processed scores, float32),
which no code on the learner's side computed. The rebuilt distribution's log-probs at those tokens must equal them to
float32 round-off at every round, stale ones included; the learner's current weights (a wrong version) must not.
Through a real ``trustbatch train`` run at k = 2 with two workers, whose kl_behavior is logged finite and ≥ 0.
"""

import json

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.policy.forward import Teacher, teacher_forced
from trustbatch.recipes import train
from trustbatch.trainer.learner import Learner

from tiny import TINY

K, T = 2, 0.8
SIGNAL = ["reward.name=scorers_for_tests:digit_fraction", "reward.workers=0", "threads=1"]
ASYNC = ["rollout.mode=async", f"rollout.max_staleness={K}", "rollout.workers=2", "objective.options={kl: exact}",
         f"rollout.temperature={T}"]


@pytest.fixture
def cache(tmp_path, monkeypatch, support_on_pythonpath):  # spawned rollout workers import the scorer module too
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))


def _sampled(teacher: Teacher, batch) -> torch.Tensor:
    """log π [N] of ``teacher``'s distribution at the batch's sampled tokens (valid positions), float32."""
    C = batch.packed.response_mask.shape[1]
    lsm = teacher_forced(batch.packed, [(None, teacher)]).log_probs(slice(None), torch.float32)
    return lsm.gather(-1, batch.packed.input_ids[:, -C:, None])[..., 0][batch.packed.response_mask]


def test_async_exact_kl_rebuilds_each_batchs_stale_behaviour(tmp_path, cache, monkeypatch):
    seen = []  # per round: (learner version, batch version, |rebuilt − recorded|, |current − recorded|)
    real = Learner.train_on

    def check_then_train(self, batch, **kw):
        (v, teacher), = batch.behaviour.items()
        recorded = batch.behavior_logprobs[batch.packed.response_mask]
        with torch.no_grad():
            rebuilt = _sampled(teacher, batch)
            current = _sampled(Teacher(self.model, T), batch)
        seen.append((self.version, v, float((rebuilt - recorded).abs().max()), float((current - recorded).abs().max())))
        return real(self, batch, **kw)

    monkeypatch.setattr(Learner, "train_on", check_then_train)
    run = tmp_path / "run"
    train(load_config(None, TINY + SIGNAL + ASYNC + ["train.steps=6", "eval.every=100", f"run_dir={run}",
                                                    "train.lr=3e-3"]))
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(seen) == len(recs) == 6
    # deterministic order, one optimizer step a round: round t trains on batch t − 1, sampled by version t − 1 − k
    assert [(lv, v) for lv, v, _, _ in seen] == [(t, max(0, t - K)) for t in range(6)]
    for lv, v, err, _ in seen:
        assert err < 1e-5, f"round at version {lv}: the rebuilt version {v} is {err:.3g} off the recorded log-probs"
    stale = [cur for lv, v, _, cur in seen if lv > v]
    assert stale and min(stale) > 1e-3  # the learner's own weights are not the behaviour of a stale batch
    for r in recs:
        assert 0.0 <= r["kl_behavior"] < float("inf") and r["staleness"] <= K
    assert max(r["kl_behavior"] for r in recs if r["staleness"] > 0) > 1e-4
