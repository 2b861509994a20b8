"""``trustbatch train rollout.decode=static`` through the real command: round 1 equals the dynamic loop's, and so do
the held-out evaluations at rounds 0 and 1, which sample with the run's loop too.

Reference: the same tiny job with the default ``rollout.decode=dynamic``. Round 1 samples from the same initial
weights with the same seeds, and the static loop samples the dynamic loop's tokens (tests/unit/test_static_decode.py),
so the batch is the same (equal rewards) and the learner's metrics differ only by the float32 round-off of the
behaviour log-probs (≤ 1e-5); the on-policy ESS is 1 within float32 round-off in both.
"""

import json
import subprocess
import sys

import trustbatch.rollout.static_decode as static_decode
from trustbatch.config import load_config
from trustbatch.eval import evaluate_heldout
from trustbatch.recipes import prepare_run
from trustbatch.recipes.build import build_parts, foreign_engine

from runproc import ROOT, cache  # noqa: F401
from tiny import TINY

COMPARED = ("loss", "grad_norm", "entropy", "ess")
HELDOUT = ("heldout_accuracy", "heldout_greedy_accuracy")


def _records(tmp_path, decode: str) -> list[dict]:
    run = tmp_path / f"run-{decode}"
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *TINY, "train.steps=1", "eval.every=100",
                        "threads=1", f"rollout.decode={decode}", f"run_dir={run}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"decode: {decode}" in (run / "config.yaml").read_text()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_static_round_equals_the_dynamic_one(tmp_path, cache):  # noqa: F811
    runs = {d: {r["step"]: r for r in _records(tmp_path, d)} for d in ("dynamic", "static")}
    for step in (0, 1):  # the base's held-out evaluation and the last round's: the same samples, the same scores
        for k in HELDOUT:
            assert runs["static"][step][k] == runs["dynamic"][step][k], (step, k)
    dynamic, static = runs["dynamic"][1], runs["static"][1]
    for k in ("reward_mean", "num_tokens", "truncated_fraction"):  # the same samples
        assert static[k] == dynamic[k], (k, static[k], dynamic[k])
    assert abs(static["ess"] - 1.0) < 1e-6, static["ess"]
    for k in COMPARED:
        assert abs(static[k] - dynamic[k]) <= 1e-5 * max(1.0, abs(dynamic[k])), (k, static[k], dynamic[k])


def test_the_heldout_and_foreign_engines_sample_with_the_runs_loop(monkeypatch, cache):  # noqa: F811
    """The engines beside the rollout engine (held-out evaluation, ``rollout.foreign_model``) take ``rollout.decode``
    and ``rollout.noise``: a fast loop chosen for the rollouts serves the evaluation too. The evaluation's samples
    come out of the static loop (a spy on ``StaticDecoder.decode``)."""
    cfg = load_config(None, [*TINY, "rollout.decode=static", "rollout.noise=philox", "reward.workers=0"])
    task, policy, pool, _ = prepare_run(cfg)
    calls = []
    real = static_decode.StaticDecoder.decode
    monkeypatch.setattr(static_decode.StaticDecoder, "decode", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    built = build_parts(cfg, task, policy, pool)
    try:
        assert (built.eval_engine.decode, built.eval_engine.noise) == ("static", "philox")
        other = foreign_engine(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
            update={"foreign_model": "initial"})}), task, policy)
        assert (other.decode, other.noise) == ("static", "philox")
        evaluate_heldout(policy, built.eval_engine, task.heldout[:2], pool, samples_per_prompt=2, temperature=1.0,
                         max_new_tokens=4)
        assert calls, "the held-out evaluation did not sample with the static loop"
    finally:
        built.parts.source.close()
        built.parts.learner.close()
        pool.close()
