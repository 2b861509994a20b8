"""``chain_sum_steps``: worked demonstrations (each partial sum, then the answer) of 20–30 tokens, a reward on the
final answer only, and config defaults that fit the completions into the default base's context."""

import json
import re

import pytest

from trustbatch import rewards
from trustbatch.config import load_config
from trustbatch.data import load_task
from trustbatch.data.tasks import DEFAULT_PARAMS
from trustbatch.errors import UserError
from trustbatch.policy.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def task():
    return load_task("chain_sum_steps", train_size=400, heldout_size=32, seed=1, params=DEFAULT_PARAMS["chain_sum_steps"])


def test_demonstrations_work_every_step_of_the_prompt_and_end_in_its_gold_answer(task):
    step = re.compile(r"(-?\d+)([+-])(\d)=(-?\d+)")
    for ex in task.train + task.heldout:
        # the prompt's own expression, read from the text: "…problem: 4 - 1 - 7 + 7 ="
        terms = ex.prompt.rsplit(":", 1)[1].removesuffix("=").split()
        *steps, final = ex.answer.split(", ")
        assert len(steps) == len(terms) // 2 == 3
        acc = int(terms[0])
        for s, op, c in zip(steps, terms[1::2], terms[2::2]):
            a, sop, b, r = step.fullmatch(s).groups()
            assert (int(a), sop, b) == (acc, op, c)
            acc = acc + int(c) if op == "+" else acc - int(c)
            assert int(r) == acc
        assert final == f"answer {acc}" and json.loads(ex.reference)["answer"] == str(acc)
    assert task.reward == "rg-final:chain_sum"
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.heldout}


def test_demonstrations_are_20_to_30_tokens_and_fit_the_context(task):
    # the tokenizer the default base trains on this task's text (policy/base.py)
    tok = train_tokenizer([e.prompt for e in task.train] + [" " + e.answer for e in task.train], vocab_size=384)
    demo = [len(tok(" " + e.answer, add_special_tokens=False)["input_ids"]) for e in task.train]
    prompt = [len(tok(e.prompt)["input_ids"]) for e in task.train + task.heldout]
    assert 20 <= min(demo) and max(demo) <= 30, (min(demo), max(demo))
    cfg = load_config(None, ["task.name=chain_sum_steps"])
    assert cfg.rollout.max_new_tokens >= max(demo) + 1  # + EOS: a correct completion is never truncated
    assert max(prompt) + cfg.rollout.max_new_tokens <= cfg.model.max_len  # fit_to_context drops nothing
    assert load_config(None, ["task.name=chain_sum_steps", "rollout.max_new_tokens=12"]).rollout.max_new_tokens == 12
    assert load_config(None, []).rollout.max_new_tokens == 8  # other tasks keep the default


def test_reward_checks_the_final_answer_only():
    score = rewards.get("rg-final:chain_sum")
    ref = json.dumps({"answer": "3", "metadata": {"expression": "4 - 1 - 7 + 7"}})
    neg = json.dumps({"answer": "-4", "metadata": {"expression": "4 - 1 - 7"}})
    assert score("4-1=3, 3-7=-4, -4+7=3, answer 3", ref) == 1.0
    assert score(" 4-1=3, 3-7=-4, answer -4", neg) == 1.0
    assert score("4-1=3, 3-7=-4, -4+7=3, answer 4", ref) == 0.0  # wrong answer
    assert score("4-1=3, 3-7=-4, answer -4", ref) == 0.0  # stopped a step early
    assert score("4-1=2, 2-7=-5, -5+7=3, answer 3", ref) == 1.0  # wrong steps, right outcome: outcome reward
    for malformed in ("4-1=3, 3-7=-4, -4+7=3", "3", "answer", "", "answer 3, 3+1=4", "4-1=3, answer 3 7"):
        assert score(malformed, ref) == 0.0, malformed
    # the bare-answer scorer of chain_sum cannot read worked steps: why the task needs its own reward
    assert rewards.get("rg:chain_sum")("4-1=3, 3-7=-4, -4+7=3, answer 3", ref) < 0.5


def test_unknown_task_names_the_steps_variant():
    with pytest.raises(UserError, match="chain_sum_steps"):
        load_task("chain_sum_stepz", train_size=4, heldout_size=2, seed=1)
