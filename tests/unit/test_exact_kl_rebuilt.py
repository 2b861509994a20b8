"""The exact KL against a behaviour (and proximal) distribution the learner rebuilds per chunk, never stores.

Reference: brute force over the full vocabulary in float64 autograd, written here without the code under test:
each model's whole ``[B, C, V]`` log-softmax from a plain forward, the KL by ``torch.distributions.kl_divergence``,
the P3O loss of arXiv 2605.12380 Eq. 11-12 (and the two-anchor mixture of docs/design/objectives.md §2), and its
gradient. The learner runs the chunked head (chunks of 2 columns), micro-batches, the shared-prompt forward and,
over two mini-batches, the frozen copy of the pre-update policy. Float64 models with float64 RMSNorm
(tests/support/llama_rows.py), so the two may differ only by float64 round-off.
"""

import copy

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.forward import Teacher, pack
from trustbatch.trainer.learner import Learner

from grad_probe import sgd_recording_grads
from llama_rows import _llama, _rows, full64 as _full64, perturbed as _perturbed

TOL = 1e-9
T_B = 0.7  # the behaviour's sampling temperature


def _batch(model, behaviour: Teacher):
    packed = pack(*_rows(), pad_id=0)
    C = packed.response_mask.shape[1]
    with torch.no_grad():
        blp = _full64(behaviour.model, packed, behaviour.temperature).gather(-1, packed.input_ids[:, -C:, None])[..., 0]
    adv = torch.randn(packed.response_mask.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return TrainBatch(packed, torch.where(packed.response_mask, blp, 0.0), adv, behaviour={0: behaviour})


def _ess(rho):
    return rho.sum() ** 2 / (rho.numel() * (rho * rho).sum())


def _brute_force(weights, batch, behaviour_full, proximal=None):
    """(gradients, loss, e) of P3O (two-anchor with ``proximal``, a model) with the exact KL, in float64 over the
    whole vocabulary, at ``weights`` on ``batch``'s rows."""
    model = copy.deepcopy(weights)
    mask, packed = batch.packed.response_mask, batch.packed
    C = mask.shape[1]
    lpf = _full64(model, packed)
    lp = lpf.gather(-1, packed.input_ids[:, -C:, None])[..., 0]
    log_mix = behaviour_full
    rho = (lp.detach() - batch.behavior_logprobs).exp()[mask]
    e = _ess(rho)
    if proximal is not None:
        with torch.no_grad():
            prox_full = _full64(proximal, packed)
        e_p = _ess((lp.detach() - prox_full.gather(-1, packed.input_ids[:, -C:, None])[..., 0]).exp()[mask])
        w_b, w_p = 1 - e, 1 - e_p
        log_mix = torch.log((w_b * behaviour_full.exp() + w_p * prox_full.exp()) / (w_b + w_p))
        e = torch.minimum(e, e_p)
    kl = kl_divergence(Categorical(logits=lpf), Categorical(logits=log_mix))
    per_token = -torch.minimum((lp.detach() - batch.behavior_logprobs).exp(), e) * batch.advantages[:, None] * lp \
        + (1 - e) * kl
    loss = torch.where(mask, per_token, 0.0).sum() / mask.sum()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, float(loss.detach()), float(e.detach())


def _close(got, want, what):
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= TOL * scale, f"{what}: max |diff| {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("case", ["p3o-other", "p3o-own-replayed", "two_anchor-replayed"])
def test_rebuilt_exact_kl_equals_float64_brute_force_with_gradients(case):
    model = _llama()
    own = "own" in case
    behaviour = Teacher(model, 1.0) if own else Teacher(_perturbed(model, 1), T_B)
    batch = _batch(model, behaviour)
    objective = "p3o_two_anchor" if case.startswith("two") else "p3o"
    replayed = "replayed" in case
    learner = Learner(model, objective, {"kl": "exact"}, micro_batch_size=5, logprob_chunk_size=2,
                      minibatches=2 if replayed else 1)
    learner.grad_clip = 1e9
    steps = []
    sgd_recording_grads(learner, model, steps)
    start = copy.deepcopy(model)  # the weights that sampled "own" rows, and the proximal snapshot
    with torch.no_grad():
        behaviour_full = _full64(start if own else behaviour.model, batch.packed, behaviour.temperature)
    torch.manual_seed(5)
    rows = torch.randperm(len(batch)).chunk(2) if replayed else [torch.arange(len(batch))]
    torch.manual_seed(5)
    learner.train_on(batch)
    records = learner.step_records
    assert len(steps) == len(rows)
    for k, ((weights, got), idx) in enumerate(zip(steps, rows)):
        want, loss, e = _brute_force(weights, batch.select(idx), behaviour_full[idx],
                                     start if objective == "p3o_two_anchor" else None)
        for n, g in want.items():
            _close(got[n], g, f"{case} step {k} grad {n}")
        assert records[k]["loss"] == pytest.approx(loss, rel=TOL)
        assert records[k]["ess"] == pytest.approx(e, rel=TOL)
    # the KL term carried weight, and the replayed step ran on moved weights against the frozen behaviour
    assert records[-1]["kl_behavior"] > 1e-3 and records[-1]["ess"] < 0.999
    if replayed:
        assert any(not torch.equal(p, q) for p, q in zip(steps[0][0].parameters(), steps[1][0].parameters()))
