"""Micro-batches trimmed to their own widths (``forward.trimmed``) give the untrimmed log-probs and gradients.

References: the same forward on the micro-batch at the batch's full width, and the learner with
``trim_micro_batches=False``; float64 models with float64 RMSNorm (see tests/support/llama_rows.py).
"""

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.forward import pack, response_logprobs, trim, trimmed
from trustbatch.policy.shared_prompt import grouped_response_logprobs
from trustbatch.trainer.learner import Learner

from grad_probe import sgd_recording_grads
from llama_rows import TOL, _close, _llama, _rows


def _short_rows_first():
    """The rows of ``_rows`` sorted by length, packed: the first half is a micro-batch narrower than the batch."""
    prompts, comps = _rows()
    order = sorted(range(len(prompts)), key=lambda i: (len(comps[i]), len(prompts[i])))
    return [prompts[i] for i in order], [comps[i] for i in order]


def test_trim_drops_only_shared_padding():
    prompts, comps = _short_rows_first()
    packed = pack(prompts, comps, pad_id=0)
    mb = packed.select(slice(0, 6))
    t = trim(mb)
    want_c = max(len(c) for c in comps[:6])
    want_l = max(len(p) + len(c) for p, c in zip(prompts[:6], comps[:6]))
    assert t.response_mask.shape == (6, want_c) < mb.response_mask.shape
    assert t.input_ids.shape == (6, want_l) and want_l < mb.input_ids.shape[1]
    for i, (p, c) in enumerate(zip(prompts[:6], comps[:6])):  # every real token kept, in place
        assert t.input_ids[i, want_l - len(p) - len(c):].tolist() == p + c
        assert int(t.attention_mask[i].sum()) == len(p) + len(c)
        assert t.response_mask[i].sum() == len(c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("forward", [response_logprobs, grouped_response_logprobs], ids=["plain", "shared"])
def test_trimmed_forward_equals_the_full_width_one(dtype, forward):
    model = _llama(dtype)
    prompts, comps = _short_rows_first()
    mb = pack(prompts, comps, pad_id=0).select(slice(0, 8))
    m = mb.response_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    results = []
    for fn in (forward, trimmed(forward)):
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, mb, with_entropy=True)
        assert lp.shape == m.shape and ent.shape == m.shape
        (lp * weights * m).sum().backward()
        results.append((lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    _close(lp1[m], lp0[m], "log-probs", TOL[dtype])
    _close(ent1[m], ent0[m], "entropy", TOL[dtype])
    for n in g0:
        _close(g1[n], g0[n], f"grad {n}", TOL[dtype])


def _sorted_batch(dtype):
    prompts, comps = _short_rows_first()
    packed = pack(prompts, comps, pad_id=0)
    B, C = packed.response_mask.shape
    g = torch.Generator().manual_seed(11)
    blp = -3.0 + 0.8 * torch.randn(B, C, generator=g, dtype=dtype)
    return TrainBatch(packed, blp, torch.randn(B, generator=g, dtype=dtype), torch.zeros(B, dtype=torch.long),
                      proximal_logprobs=blp + 0.3 * torch.randn(B, C, generator=g, dtype=dtype))


@pytest.mark.parametrize("objective,options", [("p3o", {}), ("grpo", {}), ("p3o_two_anchor", {}),
                                               ("grpo", {"aggregation": "seq_mean_token_sum"})])
def test_learner_gradient_equals_untrimmed(objective, options):
    """``step`` keeps the rows' order within a micro-batch of 4, so the short rows share micro-batches."""
    grads = []
    for trim_ in (False, True):
        model = _llama(torch.float64)
        learner = Learner(model, objective, options, lr=1e-2, grad_clip=1e9, micro_batch_size=4,
                          trim_micro_batches=trim_)
        grads.append(sgd_recording_grads(learner, model))
        batch = _sorted_batch(torch.float64)
        if learner.spec.needs_proximal is False:
            batch.proximal_logprobs = None
        learner.step(batch)
    want, got = grads
    for n in want:
        _close(got[n], want[n], f"{objective} {options} {n}", TOL[torch.float64])
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
