"""Under DAPO's dynamic sampling a round's sampling statistics cover every completion it sampled, dropped groups
included, as its ``reward_mean`` does: the groups it drops (all rewards equal) are often all cut at
``max_new_tokens``, and ``truncated_fraction`` over the kept groups alone hid them from the truncation warning.

A stand-in engine makes, for even prompts, two 4-token completions cut at the budget (both scored 0: dropped) and
for odd prompts two 1-token finished ones (scored 1 and 0: kept). Reference: the engine's own rollouts, counted
by hand."""

import pytest

from trustbatch.pipeline.source import SourceSpec, SyncSource
from trustbatch.rewards import ScoreResult
from trustbatch.rollout.engine import Rollout, SamplingParams


class _Engine:
    version = 0

    def __init__(self):
        self.made: list[Rollout] = []

    def generate(self, prompts, n, sampling, seeds=None):
        out = []
        for i, p in enumerate(prompts):
            cut = p[0] % 2 == 0
            for j in range(n):
                out.append(Rollout(i, list(p), [7] * 4 if cut else [10 + j], [-0.5] * (4 if cut else 1), cut, 0))
        self.made += out
        return out


class _Pool:
    def score(self, completions, references, **kw):
        return ScoreResult(rewards=[1.0 if c == "10" else 0.0 for c in completions], errors=0, timeouts=0)


@pytest.mark.parametrize("overlong_cache", [None, 2])
def test_the_rounds_truncation_and_length_count_the_dropped_groups_too(overlong_cache):
    engine = _Engine()
    spec = SourceSpec(SamplingParams(max_new_tokens=4), group_size=2, prompts_per_step=2, seed=3,
                      dynamic_sampling=True, max_sampling_rounds=4, overlong_cache=overlong_cache)
    src = SyncSource(engine, [[i] for i in range(8)], ["r"] * 8, _Pool(),
                     lambda ids: " ".join(str(t) for t in ids), spec, pad_id=0)
    batch = src.make_batch(0)
    m = src.last_metrics
    made = engine.made
    assert any(r.truncated for r in made) and m["groups_dropped"] >= 1  # the round did drop cut groups
    assert batch is not None
    assert m["truncated_fraction"] == sum(r.truncated for r in made) / len(made)
    assert m["response_length"] == sum(len(r.completion_ids) for r in made) / len(made)
    assert m["reward_mean"] == sum(1.0 for r in made if r.completion_ids == [10]) / len(made)


class _AllCutEngine(_Engine):
    def generate(self, prompts, n, sampling, seeds=None):
        out = [Rollout(i, list(p), [7] * 4, [-0.5] * 4, True, 0) for i, p in enumerate(prompts) for _ in range(n)]
        self.made += out
        return out


def test_a_round_that_drops_every_group_still_logs_its_truncation():
    """Every completion cut and scored 0: no group kept, no batch; the round's record still says 100 % truncated (it
    said nothing, and the truncation warning stayed silent in the worst case)."""
    engine = _AllCutEngine()
    spec = SourceSpec(SamplingParams(max_new_tokens=4), group_size=2, prompts_per_step=2, seed=3,
                      dynamic_sampling=True, max_sampling_rounds=2)
    src = SyncSource(engine, [[i] for i in range(8)], ["r"] * 8, _Pool(),
                     lambda ids: " ".join(str(t) for t in ids), spec, pad_id=0)
    assert src.make_batch(0) is None
    assert src.last_metrics["truncated_fraction"] == 1.0 and src.last_metrics["response_length"] == 4.0
    assert len(engine.made) == 8  # two sampling calls of two groups of two


class _PoolWithNone:
    """Reward 2 for the first completion of a group, 1 for the second, and no function applies to the third and
    fourth (TRL's NaN: ``ScoreResult.none``)."""

    def score(self, completions, references, **kw):
        rewards = [2.0, 1.0, 0.0, 0.0] * (len(completions) // 4)
        return ScoreResult(rewards=rewards, errors=0, timeouts=0,
                           none=[i for i in range(len(completions)) if i % 4 >= 2])


def test_a_completion_no_function_applies_to_has_no_advantage_and_is_out_of_its_groups_statistics():
    """As TRL 1.16's GRPOTrainer: it scored 0, pulled its group's mean down and got an advantage of its own.
    Reference by hand: the group's scored rewards (2, 1): mean 1.5, population σ 0.5."""
    spec = SourceSpec(SamplingParams(max_new_tokens=4), group_size=4, prompts_per_step=2, seed=3)
    src = SyncSource(_Engine(), [[i] for i in range(8)], ["r"] * 8, _PoolWithNone(),
                     lambda ids: " ".join(str(t) for t in ids), spec, pad_id=0)
    batch = src.make_batch(0)
    z = 0.5 / (0.5 + 1e-6)
    assert batch.advantages.tolist() == pytest.approx([z, -z, 0.0, 0.0] * 2, abs=1e-6)
    assert src.last_metrics["reward_mean"] == 1.5


class _TwoShortTwoCut(_Engine):
    """Each group of 4: two 1-token finished completions, then two cut at max_new_tokens=4."""

    def generate(self, prompts, n, sampling, seeds=None):
        return [Rollout(i, list(p), [7] * 4 if j >= 2 else [10 + j], [-0.5] * (4 if j >= 2 else 1), j >= 2, 0)
                for i, p in enumerate(prompts) for j in range(n)]


class _CutNotJudged:
    """The task function: ``first`` for the two short completions, None (does not apply) for the cut ones."""

    def __init__(self, first):
        self.first = first

    def score(self, completions, references, **kw):
        r = [self.first[0] if c == "10" else self.first[1] if c == "11" else 0.0 for c in completions]
        return ScoreResult(rewards=r, errors=0, timeouts=0, none=[i for i, c in enumerate(completions) if " " in c])


def _batch(pool, **kw):
    spec = SourceSpec(SamplingParams(max_new_tokens=4), group_size=4, prompts_per_step=1, seed=3, **kw)
    src = SyncSource(_TwoShortTwoCut(), [[i] for i in range(8)], ["r"] * 8, pool,
                     lambda ids: " ".join(map(str, ids)), spec, pad_id=0)
    return src.make_batch(0), src.last_metrics


def test_overlong_shaping_and_dynamic_sampling_with_completions_no_function_applies_to():
    """From a review, against TRL (its overlong shaping is a reward function, never NaN): DAPO's penalty scores a
    completion the task function does not apply to (the mask dropped it: advantage 0); dynamic sampling judges a
    group by the completions a function applies to (a (1, 1, None, None) group was kept with no signal, taking a
    slot). By hand, advantage=mean: rewards (1, 0, −1, −1) (the cut ones' penalty −1 at cache 2), mean −0.25."""
    batch, _ = _batch(_CutNotJudged((1.0, 0.0)), overlong_cache=2, advantage="mean")
    assert batch.advantages.tolist() == pytest.approx([1.25, 0.25, -0.75, -0.75])
    batch, m = _batch(_CutNotJudged((1.0, 1.0)), dynamic_sampling=True, max_sampling_rounds=1)
    assert batch is None and m["groups_dropped"] == 1.0

