"""One ``trustbatch train train.device=cuda`` round end to end: the tiny job, float32 and bf16-mixed.

The engine samples from the module the learner trains, so the first round is on policy: its ESS is 1 within
float32 round-off (the learner's log-probs are float32 in both precisions). bf16-mixed: the engine samples under the
learner's bf16 autocast, and the H200 measured 1 − ESS = 2e-10 on a bf16-mixed round (docs/performance.md, 2026-11-26);
the tolerance 1e-7 sits between that and what this test exists to catch, an engine sampling outside the autocast
(1 − ESS = 1.1e-6 for this command on the CPU; the earlier tolerance, 1e-3, passed it).
"""

import json
import subprocess
import sys

import pytest

from tiny import TINY


@pytest.mark.parametrize("precision,ess_tol", [("float32", 1e-6), ("bf16-mixed", 1e-7)])
def test_one_cuda_round(tmp_path, precision, ess_tol, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *TINY, "train.device=cuda", "train.steps=1",
                        f"train.precision={precision}", "eval.every=100", f"run_dir={run}", "threads=1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] > 0]
    assert len(rounds) == 1
    assert abs(rounds[0]["ess"] - 1.0) <= ess_tol, rounds[0]["ess"]
    assert "cuda" in (run / "config.yaml").read_text()


def test_async_rounds_with_a_cuda_learner(tmp_path, monkeypatch):
    """Rollout worker processes build their engine on the CPU from a saved copy of the policy; the learner's weights
    reach them through host memory (``weight_sync.host_weights``), then its CUDA learner trains their batches: two
    rounds, one worker, staleness bound 1. Before ``host_weights`` the process transport shared CUDA tensors."""
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *TINY, "train.device=cuda", "train.steps=2",
                        "rollout.mode=async", "rollout.max_staleness=1", "rollout.workers=1", "eval.every=100",
                        f"run_dir={run}", "threads=1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] > 0]
    assert [r["step"] for r in rounds] == [1, 2]
    assert all(0 <= r["staleness"] <= 1 for r in rounds)
