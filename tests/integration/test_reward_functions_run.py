"""Weighted reward functions through worker processes and a real training run on a data file with an extra column."""

import json

import pytest

from trustbatch.config import load_config
from trustbatch.recipes import train
from trustbatch.rewards.functions import WeightedRewards


def test_batch_form_in_worker_processes_matches_by_hand():
    terms = (("scorers_for_tests:contains_answer", 1.0), ("scorers_for_tests:column_bonus", 0.5))
    with WeightedRewards(terms, workers=1, timeout_s=30) as r:
        res = r.score(["12a", "x", "7"], ["12", "3", "5"],
                      contexts=[{"prompt": "a", "bonus": 1}, {"prompt": "b", "bonus": 0.5}, {"prompt": "5?", "bonus": 0}])
    assert res.components == {"contains_answer": [1.0, 0.0, 0.25], "column_bonus": [1.0, 0.5, 0.0]}
    assert res.rewards == pytest.approx([1.5, 0.25, 0.25]) and res.errors == res.timeouts == 0


def test_training_logs_each_function_and_their_weighted_sum(tmp_path, shared_dir):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {a + 3}?", "answer": f"#### {2 * a + 3}",
                                        "bonus": 0.75}) + "\n" for a in range(40)))
    run = tmp_path / "run"
    train(load_config(None, [
        f"data={data}", "data.heldout_size=4", f"model.path={shared_dir / 'models' / 'stories260K-hf'}",
        "reward.functions=[{name: scorers_for_tests:digit_fraction, weight: 1.0}, "
        "{name: scorers_for_tests:column_bonus, weight: 0.4}]", "reward.workers=0", "threads=1",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=2",
        "eval.every=2", "eval.samples_per_prompt=2", f"run_dir={run}"]))
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert r["rewards/column_bonus"] == 0.75  # the data's column, read by the batch-form function
        assert 0 <= r["rewards/digit_fraction"] <= 1
        assert r["reward_mean"] == pytest.approx(r["rewards/digit_fraction"] + 0.4 * 0.75, abs=1e-12)
