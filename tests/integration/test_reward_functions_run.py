"""Weighted reward functions through worker processes and a real training run on a data file with an extra column."""

import json

import pytest

from trustbatch.config import load_config
from trustbatch.recipes import train
from trustbatch.rewards.functions import WeightedRewards

from runproc import cache  # noqa: F401  (the tiny base, built once)


def test_batch_form_in_worker_processes_matches_by_hand():
    terms = (("scorers_for_tests:contains_answer", 1.0), ("scorers_for_tests:column_bonus", 0.5))
    with WeightedRewards(terms, workers=1, timeout_s=30) as r:
        res = r.score(["12a", "x", "7"], ["12", "3", "5"],
                      contexts=[{"prompt": "a", "bonus": 1}, {"prompt": "b", "bonus": 0.5}, {"prompt": "5?", "bonus": 0}])
    assert res.components == {"contains_answer": [1.0, 0.0, 0.25], "column_bonus": [1.0, 0.5, 0.0]}
    assert res.rewards == pytest.approx([1.5, 0.25, 0.25]) and res.errors == res.timeouts == 0


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_functions_outside_0_1_are_summed_as_returned_as_trl_does(workers):
    """TRL sums its reward_funcs as they return (a format penalty of −1 stays −1); a task's scorer alone
    (reward.name) is clamped into [0, 1] and warned about. Reference: the functions' values worked by hand."""
    from trustbatch.rewards import RewardPool, check_scoring

    terms = (("scorers_for_tests:digit_or_penalty", 1.0), ("scorers_for_tests:column_penalty", 0.5))
    contexts = [{"prompt": "a", "bonus": 1}, {"prompt": "b", "bonus": 0.25}, {"prompt": "c", "bonus": 0}]
    with WeightedRewards(terms, workers=workers, timeout_s=30) as r:
        res = r.score(["12a", "x", "7"], ["", "", ""], contexts=contexts)
    assert res.components == {"digit_or_penalty": [2.0, -1.0, 2.0], "column_penalty": [-2.0, -0.5, -0.0]}
    assert res.rewards == [2.0 - 1.0, -1.0 - 0.25, 2.0]
    assert res.clamped == res.errors == res.timeouts == 0
    assert check_scoring(res, scorer="f", max_failure_rate=0.0, where="round 1") is None  # nothing to warn about
    with RewardPool("scorers_for_tests:digit_or_penalty", workers=workers, timeout_s=30) as pool:
        one = pool.score(["12a", "x"], ["", ""])
    assert one.rewards == [1.0, 0.0] and one.clamped == 2  # one scorer: clamped and counted
    assert "2 rewards clamped into [0, 1]" in check_scoring(one, scorer="f", max_failure_rate=0.0, where="round 1")


def test_training_logs_each_function_and_their_weighted_sum(tmp_path, shared_dir):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {a + 3}?", "answer": f"#### {2 * a + 3}",
                                        "bonus": 0.75}) + "\n" for a in range(40)))
    run = tmp_path / "run"
    train(load_config(None, [
        f"data={data}", "data.heldout_size=4", f"model.path={shared_dir / 'models' / 'stories260K-hf'}",
        "reward.functions=[{name: scorers_for_tests:digit_fraction, weight: 1.0}, "
        "{name: scorers_for_tests:column_bonus, weight: 0.4}, {name: scorers_for_tests:column_penalty}]",
        "reward.workers=0", "threads=1",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=2",
        "eval.every=2", "eval.samples_per_prompt=2", f"run_dir={run}"]))
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert r["rewards/column_bonus"] == 0.75  # the data's column, read by the batch-form function
        assert 0 <= r["rewards/digit_fraction"] <= 1
        assert r["rewards/column_penalty"] == -1.5  # below 0, as returned (TRL's sum)
        assert r["reward_mean"] == pytest.approx(r["rewards/digit_fraction"] + 0.4 * 0.75 - 1.5, abs=1e-12)


def test_a_function_that_always_fails_stops_the_run_in_one_line_naming_it(tmp_path, cache, support_on_pythonpath):
    """Issue 46 item 4: of two reward functions, one raising on every call is exactly half the scorings, never above
    reward.max_failure_rate=0.5; its own rate (all of a round's completions) stops the real run at round 1."""
    from runproc import one_line, run, train_args

    run_dir = tmp_path / "run"
    p = run(train_args(run_dir, "train.steps=3", "reward.workers=0", "reward.max_failure_rate=0.5",
                       "reward.functions=[{name: scorers_for_tests:digit_fraction}, "
                       "{name: scorers_for_tests:always_raises}]"))
    assert p.returncode == 2, p.stderr[-3000:]
    line = one_line(p.stderr)
    assert "reward function 'always_raises'" in line and "failed on 100% of completions" in line, line
    assert "reward.max_failure_rate=0.5" in line and "always_raises: no score" in line, line
    trained = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert trained == []  # round 1 is refused before its update
