"""``trustbatch train rollout.decode=static`` through the real command: round 1 equals the dynamic loop's.

Reference: the same tiny job with the default ``rollout.decode=dynamic``. Round 1 samples from the same initial
weights with the same seeds, and the static loop samples the dynamic loop's tokens (tests/unit/test_static_decode.py),
so the batch is the same (equal rewards) and the learner's metrics differ only by the float32 round-off of the
behaviour log-probs (≤ 1e-5); the on-policy ESS is 1 within float32 round-off in both.
"""

import json
import subprocess
import sys

from runproc import ROOT, cache  # noqa: F401
from tiny import TINY

COMPARED = ("loss", "grad_norm", "entropy", "ess")


def _round_one(tmp_path, decode: str) -> dict:
    run = tmp_path / f"run-{decode}"
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *TINY, "train.steps=1", "eval.every=100",
                        "threads=1", f"rollout.decode={decode}", f"run_dir={run}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"decode: {decode}" in (run / "config.yaml").read_text()
    return next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1)


def test_static_round_equals_the_dynamic_one(tmp_path, cache):  # noqa: F811
    dynamic, static = _round_one(tmp_path, "dynamic"), _round_one(tmp_path, "static")
    for k in ("reward_mean", "num_tokens", "truncated_fraction"):  # the same samples
        assert static[k] == dynamic[k], (k, static[k], dynamic[k])
    assert abs(static["ess"] - 1.0) < 1e-6, static["ess"]
    for k in COMPARED:
        assert abs(static[k] - dynamic[k]) <= 1e-5 * max(1.0, abs(dynamic[k])), (k, static[k], dynamic[k])
