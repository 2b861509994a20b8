"""Several weighted reward functions and TRL's batch form, scored in this process (workers=0), checked by hand."""

import pytest

from trustbatch import rewards
from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.rewards.functions import WeightedRewards, labels
from trustbatch.rewards.scorers import BatchForm, takes_batch

COMPLETIONS = ["12a", "x", "7", "the answer is 42"]
REFERENCES = ["12", "3", "5", "42"]
CONTEXTS = [{"prompt": "what is 12?", "bonus": 0.5}, {"prompt": "p", "bonus": 1},
            {"prompt": "is it 5?", "bonus": 0}, {"prompt": "q", "bonus": 0.25}]


def test_batch_form_is_detected_by_its_completions_parameter():
    from scorers_for_tests import column_bonus, digit_fraction

    assert takes_batch(column_bonus) and not takes_batch(digit_fraction)
    assert isinstance(rewards.get("scorers_for_tests:column_bonus"), BatchForm)
    assert not isinstance(rewards.get("scorers_for_tests:digit_fraction"), BatchForm)


def test_weighted_sum_and_components_by_hand():
    terms = (("scorers_for_tests:digit_fraction", 1.0), ("scorers_for_tests:contains_answer", 0.5),
             ("scorers_for_tests:column_bonus", 2.0))
    with WeightedRewards(terms, workers=0) as r:
        res = r.score(COMPLETIONS, REFERENCES, contexts=CONTEXTS)
    digits = [2 / 3, 0.0, 1.0, 2 / 16]  # digit characters / characters, counted by hand
    contains = [1.0, 0.0, 0.25, 1.0]  # "12" in "12a"; "3" nowhere; "5" only in the prompt; "42" in the completion
    bonus = [0.5, 1.0, 0.0, 0.25]  # the data column
    assert res.components["digit_fraction"] == pytest.approx(digits)
    assert res.components["contains_answer"] == contains
    assert res.components["column_bonus"] == bonus
    assert res.rewards == pytest.approx([d + 0.5 * c + 2 * b for d, c, b in zip(digits, contains, bonus)])
    assert res.errors == res.timeouts == 0 and res.functions == 3


def test_a_failing_function_counts_over_completions_times_functions():
    terms = (("scorers_for_tests:digit_fraction", 1.0), ("scorers_for_tests:misbehave", 1.0))
    completions = ["raise", "7", "raise", "x"]  # misbehave raises on "raise": 2 of the 4 completions
    with WeightedRewards(terms, workers=0) as r:
        res = r.score(completions, REFERENCES)
    assert res.errors == 2 and res.components["misbehave"] == [0.0, 0.0, 0.0, 0.0]
    assert "misbehave" in res.last_error and "scorer bug" in res.last_error
    # 2 failures of 8 scorings (25 %), and misbehave's own 2 of 4 (50 %): at the limit, so only a warning
    warning = rewards.check_scoring(res, scorer=r.name, max_failure_rate=0.5, where="round 1")
    assert "2 errors" in warning and "8 scorings" in warning
    with pytest.raises(UserError, match="reward function 'misbehave' .* failed on 50% of completions \\(2 of 4\\)"):
        rewards.check_scoring(res, scorer=r.name, max_failure_rate=0.4, where="round 1")
    # stopped early, the rest unscored: the share is of the round, which the message says (it read as 75 % failing)
    with WeightedRewards(terms, workers=0) as r:
        res = r.score(["raise", "raise", "raise", "x"], REFERENCES, max_failure_rate=0.25)
    assert res.unscored > 0
    with pytest.raises(UserError, match=r"\(2 of 4; scoring stopped once it was above the limit\)"):
        rewards.check_scoring(res, scorer=r.name, max_failure_rate=0.25, where="round 1")


def test_a_function_that_always_fails_is_judged_on_its_own_rate():
    """Issue 46 item 4: one broken function of two is 50 % of the scorings, never above max_failure_rate=0.5; its
    own rate, 4 of 4 completions, is."""
    terms = (("scorers_for_tests:digit_fraction", 1.0), ("scorers_for_tests:batch_wrong_length", 1.0))
    with WeightedRewards(terms, workers=0) as r:
        res = r.score(COMPLETIONS, REFERENCES, contexts=CONTEXTS)
    assert res.errors == 4 and res.components["batch_wrong_length"] == [0.0] * 4
    assert res.failures["digit_fraction"] == (0, None) and res.failures["batch_wrong_length"][0] == 4
    with pytest.raises(UserError) as e:
        rewards.check_scoring(res, scorer=r.name, max_failure_rate=0.5, where="round 1")
    assert "reward function 'batch_wrong_length'" in str(e.value) and "(4 of 4)" in str(e.value)
    assert "one score per completion" in str(e.value) and "\n" not in str(e.value)
    # the rounds of one training step add up (dynamic sampling): the rate stays per function
    both = res + res
    assert both.failures["batch_wrong_length"][0] == 8 and both.failures["digit_fraction"][0] == 0
    with pytest.raises(UserError, match="batch_wrong_length' .*\\(8 of 8\\)"):
        rewards.check_scoring(both, scorer=r.name, max_failure_rate=0.5, where="round 1")


def test_labels_name_each_function_once():
    assert labels(["gsm8k", "m:fmt", "n:fmt", "rg:basic_arithmetic"]) == ["gsm8k", "fmt#0", "fmt#1",
                                                                        "rg:basic_arithmetic"]


def test_config_refuses_name_and_functions_together():
    cfg = load_config(None, ["reward.functions=[{name: gsm8k, weight: 0.5}, {name: m:f}]"])
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [("gsm8k", 0.5), ("m:f", 1.0)]
    with pytest.raises(UserError, match="reward.name and reward.functions"):
        load_config(None, ["reward.name=gsm8k", "reward.functions=[{name: m:f}]"])
