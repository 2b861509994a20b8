"""Padding-free micro-batches (``policy.packed``) give the padded forward's log-probs and gradients.

Reference: ``forward.response_logprobs`` on the left-padded micro-batch (sdpa attention), float64
models with float64 RMSNorm (tests/support/llama_rows.py), to 1e-10 relative. The padded eager
reference is not used: its fully masked padding rows give NaN gradients in this tiny float64 Llama.
Eager attention takes its softmax in float32 (``softmax(..., dtype=torch.float32)`` in transformers),
so a float64 model under eager carries float32 round-off: 1e-6 there, 1e-10 under sdpa.
"""

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.chunked_logprobs import KLReference
from trustbatch.policy.forward import pack, response_logprobs
from trustbatch.policy.packed import packed_response_logprobs
from trustbatch.trainer.learner import Learner

from grad_probe import sgd_recording_grads
from llama_rows import _close, _llama, _rows

TOL = 1e-10
TOL_EAGER = 1e-6


def _model(attn="sdpa"):
    model = _llama(torch.float64)
    model.config._attn_implementation = attn
    return model


def _inputs_seen(model):
    """Records the [1, N] input ids of each model call."""
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    return seen


def _run(fn, model, packed, weights, **kw):
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, packed, with_entropy=True, **kw)
    (lp * weights * packed.response_mask).sum().backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk_size", [None, 2], ids=["full_head", "chunked_head"])
@pytest.mark.parametrize("share,attn", [(False, "sdpa"), (True, "sdpa"), (True, "eager")],
                         ids=["plain", "shared_sdpa", "shared_eager"])
def test_packed_equals_padded(share, attn, chunk_size):
    prompts, comps = _rows()
    packed = pack(prompts, comps, pad_id=0)
    m = packed.response_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = _run(response_logprobs, _model(), packed, weights, chunk_size=chunk_size)
    model = _model(attn)
    seen = _inputs_seen(model)
    got = _run(packed_response_logprobs, model, packed, weights, chunk_size=chunk_size, share_prompts=share,
               min_saving=0.0)
    # rows no longer than the longest item (a sequence; or a distinct prompt less its last token, with each of its
    # completions and the token before it), fewer positions than the padded layout, and every real token in them
    if share:
        groups = {}
        for p, c in zip(prompts, comps):
            groups.setdefault(tuple(p[:-1]), []).append(len(c) + 1)
        items = [len(p) + sum(cs) for p, cs in groups.items()]
    else:
        items = [len(p) + len(c) for p, c in zip(prompts, comps)]
    assert len(seen) == 1
    R, W = seen[0].shape
    assert W == max(items) and sum(items) <= R * W < packed.input_ids.numel()
    tol = TOL_EAGER if attn == "eager" else TOL
    _close(got[0][m], want[0][m], "log-probs", tol)
    _close(got[1][m], want[1][m], "entropy", tol)
    for name in want[2]:
        _close(got[2][name], want[2][name], f"grad {name}", tol)
    assert max(float(g.abs().max()) for g in want[2].values()) > 1e-3


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared"])
def test_packed_full_log_softmax_and_exact_kl_equal_padded(share):
    prompts, comps = _rows(seed=2)
    packed = pack(prompts, comps, pad_id=0)
    m = packed.response_mask
    B, C = m.shape
    ref = torch.log_softmax(torch.randn(B, C, 40, generator=torch.Generator().manual_seed(5), dtype=torch.float64), -1)
    outs = []
    for fn, kw in ((response_logprobs, {}), (packed_response_logprobs, dict(share_prompts=share, min_saving=0.0))):
        model = _model()
        with torch.no_grad():
            full = fn(model, packed, with_full=True, chunk_size=2, **kw)[2]
        lp, _, kl = fn(model, packed, kl_reference=KLReference((ref,), m), chunk_size=2, **kw)
        (kl * m).sum().backward()
        outs.append((full, kl.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (f0, kl0, g0), (f1, kl1, g1) = outs
    _close(f1[m], f0[m], "full log-softmax", TOL)
    _close(kl1[m], kl0[m], "exact KL", TOL)
    for name in g0:
        _close(g1[name], g0[name], f"KL grad {name}", TOL)


def test_learner_padding_free_gradient_equals_padded():
    prompts, comps = _rows(seed=4)
    packed = pack(prompts, comps, pad_id=0)
    B, C = packed.response_mask.shape
    grads = []
    for padding_free in (False, True):
        model = _model()
        learner = Learner(model, "p3o", {}, lr=1e-2, grad_clip=1e9, micro_batch_size=5, padding_free=padding_free)
        grads.append(sgd_recording_grads(learner, model))
        g = torch.Generator().manual_seed(11)
        blp = -3.0 + 0.8 * torch.randn(B, C, generator=g, dtype=torch.float64)
        learner.step(TrainBatch(packed, blp, torch.randn(B, generator=g, dtype=torch.float64)))
    want, got = grads
    for name in want:
        _close(got[name], want[name], f"learner grad {name}", TOL)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
