"""``reward.max_failure_rate`` judges a rollout round whole on several ranks, as in one process: each rank scored
its share and judged that share alone, so a round of 6 failures in 16 (37.5 %, under a limit of 50 %) stopped rank 0
(6 of its 8) while rank 1 waited in the next collective.

Two gloo ranks make the same batch from a stand-in engine; the scorer fails on three of each group's four
completions in rank 0's process alone. By hand: 2 groups × 3 failures = 6 of 16 completions."""

import os

from trustbatch.errors import UserError
from trustbatch.pipeline.source import SourceSpec, SyncSource
from trustbatch.rewards.objects import reward_name
from trustbatch.rewards.pool import RewardPool
from trustbatch.rewards.spec import RewardSpec
from trustbatch.rollout.engine import Rollout, SamplingParams

from gloo_ranks import two_gloo_ranks

P, G = 4, 4


class _Engine:
    version = 0

    def generate(self, prompts, n, sampling, seeds=None):
        return [Rollout(i, p, [p[0], k + 1], [-0.5, -0.5], False, 0) for i, p in enumerate(prompts) for k in range(n)]


def flaky_on_rank_0(completion: str, reference: str) -> float:
    if os.environ.get("RANK") == "0" and completion.split()[1] != "4":
        raise RuntimeError("boom")
    return 1.0


def _round(world, out_dir):
    rewards = RewardSpec(reward_name(flaky_on_rank_0), workers=0, max_failure_rate=0.5)
    source = SyncSource(_Engine(), [[j + 10] for j in range(8)], ["x"] * 8, rewards.pool(),
                        lambda ids: f"{ids[0]} {ids[1]}", SourceSpec(SamplingParams(max_new_tokens=2), G, P, seed=0),
                        pad_id=0, world=world, check_round=rewards.check("a rollout round"))
    try:
        batch = source.make_batch(0)
    except UserError as e:
        return str(e)
    return batch.metrics["reward_errors"], len(batch.advantages)


def test_a_round_is_judged_whole_on_every_rank(tmp_path):
    results = two_gloo_ranks(_round, tmp_path)
    assert results == [(6.0, P * G)] * 2, results
