"""pass@k counts a sample as correct when it gets the full reward, not a partial-credit scorer's share.

reasoning-gym's ``chain_sum`` scorer (its own ``score_answer``, run here) gives 0.5 to ``18`` and ``-8`` for the
answer 8 and 0.2 to ``81110``; at the earlier threshold (reward ≥ 0.5) the first two counted as solving the prompt.
By hand: of the four completions of the first prompt only ``8`` solves it; of the second's, ``8`` and `` 8 ``.
"""

from __future__ import annotations

import json

import pytest

from trustbatch.data import Example
from trustbatch.eval.sampling import sample_and_score
from trustbatch.rewards import ScoreResult, get
from trustbatch.rollout.engine import Rollout

pytest.importorskip("reasoning_gym")

TEXTS = {0: ["8", "18", "-8", "81110"], 1: ["8", " 8 ", "9", "-8"]}


class _Engine:
    def generate(self, prompts, n, sampling, seeds=None):
        return [Rollout(prompt_index=i, prompt_ids=p, completion_ids=[100 * p[0] + j], behavior_logprobs=[-1.0],
                        truncated=False, policy_version=0) for i, p in enumerate(prompts) for j in range(n)]


class _Policy:
    def encode_prompt(self, text):
        return [int(text.split()[1])]

    def decode(self, ids):
        return TEXTS[ids[0] // 100][ids[0] % 100]


class _Pool:  # the real reasoning-gym scorer, in this process
    def score(self, completions, references, contexts=None, **kw):
        f = get("rg:chain_sum")
        return ScoreResult(rewards=[f(c, r) for c, r in zip(completions, references)], errors=0, timeouts=0)


def test_a_partial_credit_is_not_a_solved_sample():
    ref = json.dumps({"question": "q", "answer": "8", "metadata": {}})
    f = get("rg:chain_sum")
    assert [f(t, ref) for t in TEXTS[0]] == [1.0, 0.5, 0.5, 0.2]  # the scorer's own partial credit
    examples = [Example(prompt=f"prompt {i}", reference=ref, answer="8") for i in range(2)]
    s = sample_and_score(_Policy(), _Engine(), examples, _Pool(), n=4, temperature=1.0, max_new_tokens=4)
    assert s.correct == [1, 2]
    assert s.pass_at(1)[0] == pytest.approx((1 / 4 + 2 / 4) / 2, abs=1e-12)
    assert s.pass_at(4)[0] == 1.0
    assert s.reward_mean == pytest.approx((1 + 0.5 + 0.5 + 0.2 + 1 + 1 + 0 + 0.5) / 8, abs=1e-12)  # the mean reward
