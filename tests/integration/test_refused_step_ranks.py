"""A step that one rank's objective refuses is skipped on every rank, under DDP and FSDP2, and the next step trains.

Rank 0 refuses its only (so last) micro-batch: once in the objective's forward (a non-finite loss) and once in its
backward (a gradient beyond float16 log-probs' range, ``_GradGuard``); rank 1's batch is fine both times. A rank
that skipped or cut short its backward left DDP's gradient all-reduce, or FSDP2's reduce-scatter, to the other rank
alone: gloo then failed with "Is there a distributed collective mismatch" (or waited out its timeout). Two gloo
ranks on CPU; NCCL was not run here.
"""

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from trustbatch.trainer.learner import Learner

from gloo_ranks import two_gloo_ranks
from test_fsdp2 import _model, _whole
from test_parallel import _batch


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: _whole(p.detach()).clone() for n, p in model.named_parameters()}


def _refused_then_trained(world, out_dir: Path, strategy: str) -> dict:
    model = _model()
    learner = Learner(model, "grpo", {}, lr=1e-2, grad_clip=1e9, micro_batch_size=8, world=world, strategy=strategy)
    batch = _batch(7).select(world.shard(7))
    real = learner.spec.fn

    def in_forward(*args, **kwargs):
        raise ValueError("grpo: the loss is nan (this test's refusal)")

    def in_backward(logp, blp, adv, mask, **kwargs):  # |dL/dlogp| ~ 1e9 / tokens: beyond float16's 65504
        return real(logp.half(), blp, adv * 1e9, mask, **kwargs)

    causes, skip = [], learner._skip
    learner._skip = lambda cause: (causes.append(cause), skip(cause))[1]
    steps, weights = [], [_weights(model)]
    for refusal in (in_forward, in_backward, None):
        fn = refusal if refusal is not None and world.rank == 0 else real
        learner.spec = dataclasses.replace(learner.spec, fn=fn)
        steps.append(learner.step(batch))
        weights.append(_weights(model))
    return {"steps": steps, "weights": weights, "version": learner.version, "causes": causes}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_step_one_rank_refuses_is_skipped_on_both(tmp_path, strategy):
    ranks = two_gloo_ranks(functools.partial(_refused_then_trained, strategy=strategy), tmp_path)
    refused_forward, refused_backward = ranks[0]["causes"]
    assert "this test's refusal" in refused_forward and "beyond that dtype's range" in refused_backward
    for rank, r in enumerate(ranks):
        assert [s["nonfinite_skipped"] for s in r["steps"]] == [1.0, 1.0, 0.0], rank
        assert r["version"] == 1, rank
        before, after_forward, after_backward, trained = r["weights"]
        for n in before:
            assert torch.equal(after_forward[n], before[n]) and torch.equal(after_backward[n], before[n]), (rank, n)
        assert any(not torch.equal(trained[n], before[n]) for n in before), rank
    for n in ranks[0]["weights"][0]:
        torch.testing.assert_close(ranks[0]["weights"][-1][n], ranks[1]["weights"][-1][n], rtol=0, atol=0)
