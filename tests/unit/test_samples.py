"""Sample completions (``log.samples``, issue 45 item 5): which rows of a round's batch and of an evaluation become
samples, and their fields (prompt, completion, reward, reference answer, behaviour log-prob sum), against rollouts
made by hand: the packed batch is unpacked back to each row's own completion and log-probs.

What a run writes and the trackers hold is tested in tests/integration/test_trackers.py.
"""

from __future__ import annotations

import json

import torch

from trustbatch.data import Example
from trustbatch.eval.sampling import sample_and_score
from trustbatch.pipeline.batch import build_batch
from trustbatch.recipes.hooks import batch_samples
from trustbatch.rewards import ScoreResult
from trustbatch.rollout.engine import Rollout
from trustbatch.trainer.runlog import MetricsLog


def _decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


EXAMPLES = [Example(prompt=f"prompt {i}", reference=f"ref {i}", answer="") for i in range(5)]


def _rollout(k: int, prompt_index: int, n_prompt: int, n_completion: int) -> Rollout:
    # binary fractions: float32 holds them exactly, so the sums below are exact in any order
    return Rollout(prompt_index=prompt_index, prompt_ids=[100 + prompt_index] * n_prompt,
                   completion_ids=[10 * k + j for j in range(n_completion)],
                   behavior_logprobs=[-(k + 1) / 8 - j / 4 for j in range(n_completion)], truncated=False,
                   policy_version=0)


def test_batch_samples_take_each_groups_first_completion_then_the_seconds():
    G = 2  # three groups of two rows, of prompts 3, 0, 4; prompts and completions of different lengths
    prompts = [3, 3, 0, 0, 4, 4]
    rollouts = [_rollout(k, p, n_prompt=1 + k % 3, n_completion=1 + (k * 2) % 5) for k, p in enumerate(prompts)]
    rewards = [0.0, 1.0, 0.25, 0.5, 0.75, 1.0]
    batch = build_batch(rollouts, torch.zeros(6), pad_id=0, rewards=rewards, prompt_index=prompts)
    got = batch_samples(batch, 4, G, EXAMPLES, _decode)
    want = [{"prompt": f"prompt {prompts[r]}", "completion": _decode(rollouts[r].completion_ids), "reward": rewards[r],
             "reference": f"ref {prompts[r]}", "behaviour_logprob_sum": sum(rollouts[r].behavior_logprobs)}
            for r in (0, 2, 4, 1)]
    assert got == want
    assert batch_samples(batch.select([1, 4]), 2, 1, EXAMPLES, _decode) == [want[3], want[2]]  # select keeps them


class _Engine:
    """Two completions per prompt with the log-probs of ``_rollout``."""

    def generate(self, prompts, n, sampling, seeds=None):
        return [_rollout(2 * i + j, i, 1, 1 + j) for i in range(len(prompts)) for j in range(n)]


class _Policy:
    def encode_prompt(self, text):
        return [int(text.split()[1])]

    def decode(self, ids):
        return _decode(ids)


class _Pool:
    def score(self, completions, references, contexts=None, **kw):
        return ScoreResult(rewards=[len(c) / 100 for c in completions], errors=0, timeouts=0)


def test_an_evaluations_samples_are_the_first_completion_of_its_first_prompts():
    s = sample_and_score(_Policy(), _Engine(), EXAMPLES, _Pool(), n=2, temperature=1.0, max_new_tokens=4,
                         chunk_prompts=2, keep_samples=3)  # the third prompt is in the second chunk
    assert s.samples == [{"prompt": f"prompt {i}", "completion": _decode([20 * (i % 2)]),
                          "reward": len(_decode([20 * (i % 2)])) / 100, "reference": f"ref {i}",
                          "behaviour_logprob_sum": -(2 * (i % 2) + 1) / 8} for i in range(3)]


def test_samples_jsonl_lines_carry_round_and_split_and_a_resume_cuts_them_back(tmp_path):
    log = MetricsLog(tmp_path)
    row = {"prompt": "p", "completion": "c", "reward": 1.0, "reference": "r", "behaviour_logprob_sum": -0.5}
    for r in range(4):
        log.log_samples(r, "heldout" if r % 2 == 0 else "train", [row])
    log.truncate_after(2)
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"round": r, "split": s, **row} for r, s in ((0, "heldout"), (1, "train"), (2, "heldout"))]
