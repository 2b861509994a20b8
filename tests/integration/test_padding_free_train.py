"""``trustbatch train train.padding_free=true`` through the real command: the learner's round equals the padded one's.

Reference: the same tiny job with ``train.padding_free=false``. Round 1 samples from the same initial weights, so the
batches are the same and the learner's metrics (loss, gradient norm, entropy, ESS) may differ only by float32
round-off of the two forwards; with ``objective.options={kl: exact}`` also the exact KL against the behaviour
distribution, which the packed learner rebuilds through its packed forward (``policy.packed.packed_teacher_forced``).
"""

import json
import subprocess
import sys

import pytest

from runproc import ROOT, cache  # noqa: F401
from tiny import TINY

COMPARED = ("loss", "grad_norm", "entropy", "ess", "kl_behavior")


def _round_one(tmp_path, padding_free: bool, *extra: str) -> dict:
    run = tmp_path / f"run-{padding_free}"
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *TINY, "train.steps=1", "eval.every=100",
                        "threads=1", f"train.padding_free={str(padding_free).lower()}", f"run_dir={run}", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1)


# slow for k3 (make test-slow): the exact case runs the same packed log-probs and, beside them, the packed teacher
@pytest.mark.parametrize("kl", [pytest.param("k3", marks=pytest.mark.slow), "exact"])
def test_padding_free_round_equals_the_padded_one(tmp_path, cache, kl):  # noqa: F811
    # exact: sampled at T = 0.7, so that the behaviour distribution differs from the learner's (T = 1) and the KL is > 0
    extra = [f"objective.options={{kl: {kl}}}"] + (["rollout.temperature=0.7"] if kl == "exact" else [])
    padded, packed = _round_one(tmp_path, False, *extra), _round_one(tmp_path, True, *extra)
    assert packed["reward_mean"] == padded["reward_mean"]  # the same batch
    compared = [k for k in COMPARED if k in padded]
    assert "loss" in compared and "grad_norm" in compared, sorted(padded)
    if kl == "exact":
        assert "kl_behavior" in compared and 1e-4 < packed["kl_behavior"] < float("inf"), packed.get("kl_behavior")
    for k in compared:
        assert abs(packed[k] - padded[k]) <= 1e-5 * max(1.0, abs(padded[k])), (k, packed[k], padded[k])
