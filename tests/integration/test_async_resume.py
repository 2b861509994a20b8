"""Issue 12 item 5: an asynchronous run's checkpoint records the policy version, and a resume continues the run.

A real ``trustbatch train`` with one rollout worker process and k = 1 is killed (SIGKILL) after a
checkpoint, with rounds logged past it; ``--resume`` then finishes it. Checked from the files the runs
write: the checkpoint's policy version and batch index, the versions in metrics.jsonl (monotone and
continuing from the checkpoint's), the staleness of every trained-on sample from its tag, and no process
of the killed run left alive.
"""

import signal
import time

from trustbatch.recipes import train
from trustbatch.trainer.checkpoint import latest_checkpoint, load_trainer_state

from runproc import cache, descendants, n_records, records, start, survivors, train_args  # noqa: F401

K = 1
ASYNC = ["reward.name=scorers_for_tests:digit_fraction", "reward.workers=0", "train.steps=6", "checkpoint_every=2",
         "eval.every=100", "rollout.mode=async", f"rollout.max_staleness={K}", "rollout.workers=1"]


# support_on_pythonpath: the trainer and its spawned rollout workers import the scorer module
def test_a_killed_async_run_resumes_from_its_checkpoints_policy_version(tmp_path, cache, support_on_pythonpath):
    run = tmp_path / "run"
    proc = start(train_args(run, *ASYNC), tmp_path / "first.log")
    try:  # rounds 0-3 logged: the checkpoint of round 2 is written, round 3 is past it
        deadline = time.time() + 300
        while n_records(run) < 4:  # a sleeping poll: a round lasts far longer, and the run needs the cores
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before round 3"
            assert time.time() < deadline, "timed out waiting for round 3"
            time.sleep(0.02)
        kids = descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert kids, "the run had no rollout worker process"
    assert not survivors(kids, within=10), "processes of the killed run outlived it"
    assert not (run / "summary.json").exists(), "killed after the run had finished"

    ckpt = latest_checkpoint(run)
    state = load_trainer_state(ckpt)
    s = int(state["step"])
    logged_before = records(run)
    assert s % 2 == 0 and 2 <= s < len(logged_before) - 1 < 6, (s, len(logged_before))
    # the checkpoint records the policy version (one optimizer step a round) and the next batch to make
    assert state["learner"]["policy_version"] == s and state["source"]["batch_index"] == s

    train(resume=str(run))
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(7))
    assert recs[:s + 1] == logged_before[:s + 1]  # the rounds up to the checkpoint are kept as they were
    # the learner's version continues from the checkpoint's, one step a round: monotone across the resume
    assert [r["policy_version"] for r in recs[1:]] == list(range(1, 7))
    after = recs[s + 1:]
    # the resumed worker starts from the checkpoint's policy: nothing sampled before the kill is trained on
    assert after[0]["behaviour_version"] == s and after[0]["staleness"] == 0
    for r in after:
        assert r["policy_version"] - r["optimizer_steps"] - r["behaviour_version"] == r["staleness"]
        assert s <= r["behaviour_version"] and 0 <= r["staleness"] <= K, r
    assert max(r["staleness"] for r in after) >= 1  # the resumed pipeline did run ahead
    segments = records(run, "segments.jsonl")
    assert [g["start_round"] for g in segments] == [0, s]
