"""The chunked LM head (``policy.chunked_logprobs``) gives the full path's log-probs, entropy, exact KL and gradients.

References: the full path (the whole [B, C, V] logits through autograd, which the learner ran before
chunking existed) on float64 models, where everything is float64 (the log-prob contract: at least float32),
so the two may differ only by float64 summation order (the LM-head weight's gradient sums chunk by
chunk): 1e-10 of each tensor's scale. The pure function is also checked against float64 math written
out here. Every chunked case uses several
chunks that do not divide the width (C = 7 in chunks of 2 or 3), and checks that the chunked path ran.
"""

import types
from pathlib import Path

import pytest
import torch

from trustbatch import objectives
from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy import chunked_logprobs as cl
from trustbatch.policy.chunked_logprobs import (HeadInput, KLReference, RecordedInput, TeacherForced, chunked_logprobs,
                                               full_logprobs)
from trustbatch.policy.forward import Teacher, pack, response_logprobs, teacher_forced
from trustbatch.policy.shared_prompt import grouped_response_logprobs
from trustbatch.trainer.learner import Learner
from trustbatch.parallel import World

from gloo_ranks import two_gloo_ranks
from grad_probe import sgd_recording_grads
from llama_rows import _f64_rmsnorm

V = 40
TOL = 1e-10


def _close(got, want, what, tol=TOL):
    got, want = got.detach().double(), want.detach().double()
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= tol * scale + 1e-300, f"{what}: max |diff| {err:.3g} vs scale {scale:.3g} (tol {tol:g})"


def _llama(tied=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).double()
    # RMSNorm in float64 (tests/support/llama_rows.py): with float64 log-probs, the float32 rounding inside
    # transformers' norm would tell apart forwards over other row layouts (shared prompt, DDP shards)
    for mod in model.modules():
        if type(mod).__name__ == "LlamaRMSNorm":
            mod.forward = types.MethodType(_f64_rmsnorm, mod)
    return model


def _rows(seed=1):
    """Two rows per prompt (prompts of 1 to 4 tokens), completions of 1..7 tokens: C = 7."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for n, lens in ((3, (7, 2)), (4, (5, 1)), (1, (3, 6)), (2, (4, 7))):
        p = torch.randint(3, V, (n,), generator=g).tolist()
        for c in lens:
            prompts.append(p)
            comps.append(torch.randint(3, V, (c,), generator=g).tolist())
    return prompts, comps


def _dist(g, *shape):
    return torch.log_softmax(2.0 * torch.randn(*shape, V, generator=g), -1)  # float32, as the engine stores them


def _stored(seed=1):
    """(packed, two [B, C, V] float32 log-prob tensors): stored reference distributions."""
    g = torch.Generator().manual_seed(seed + 100)
    packed = pack(*_rows(seed), pad_id=0)
    B, C = packed.response_mask.shape
    return packed, _dist(g, B, C), _dist(g, B, C)


def _sharp_llama(seed):
    """A float64 llama whose logits spread over ~±10 (the LM head scaled up): far from ``_llama``'s policy."""
    model = _llama(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)
    return model


B_TEMPERATURE = 0.8


def _batch(seed=1) -> TrainBatch:
    """The rows of ``_rows``, sampled (as far as the objectives can tell) by ``_sharp_llama`` at T = 0.8: its
    log-probs at the tokens and its ``Teacher``."""
    g = torch.Generator().manual_seed(seed + 100)
    packed = pack(*_rows(seed), pad_id=0)
    B, C = packed.response_mask.shape
    m = packed.response_mask
    behaviour = _sharp_llama(seed + 7)
    with torch.no_grad():
        logits = behaviour(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                           position_ids=packed.position_ids).logits[:, -C - 1:-1]
    blp = torch.log_softmax(logits / B_TEMPERATURE, -1).gather(-1, packed.input_ids[:, -C:, None]).squeeze(-1)
    return TrainBatch(packed, torch.where(m, blp, 0.0).float(), torch.randn(B, generator=g),
                      behaviour={0: Teacher(behaviour, B_TEMPERATURE)})


class _HeadPositions:
    """Records how many positions each LM-head call computes (0: the chunked path took the hidden states)."""

    def __init__(self, model):
        self.seen = []
        self.h = model.lm_head.register_forward_hook(lambda _m, _a, out: self.seen.append(out.shape[1]))


# ---- the pure function ---------------------------------------------------------------------------


def _head_inputs(seed=0, B=3, C=7, H=5, Vs=11, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, C, H, generator=g, dtype=dtype).requires_grad_(True)
    w = torch.randn(Vs, H, generator=g, dtype=dtype).requires_grad_(True)
    b = torch.randn(Vs, generator=g, dtype=dtype).requires_grad_(True)
    y = torch.randint(0, Vs, (B, C), generator=g)
    m = torch.rand(B, C, generator=g) > 0.3
    refs = [torch.log_softmax(torch.randn(B, C, Vs, generator=g), -1) for _ in range(2)]
    cot = [torch.randn(B, C, generator=g, dtype=torch.float32) for _ in range(2)]
    return h, w, b, y, m, refs, cot


def _ref(refs, m, two):
    if not two:
        return KLReference((refs[0],), m)
    lw = tuple(torch.tensor(x, dtype=torch.float64).log() for x in (0.3, 0.5, 0.8))
    return KLReference(tuple(refs), m, lw[:2], lw[2])


def _grads(fn, h, w, b, cot):
    for t in (h, w, b):
        t.grad = None
    logp, ent, kl = fn()
    (logp * cot[0] + kl * cot[1]).sum().backward()
    return (logp, ent, kl), [t.grad.clone() for t in (h, w, b)]


@pytest.mark.parametrize("two", [False, True], ids=["behaviour", "mixture"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 6, 9])
def test_chunked_head_equals_the_full_path_values_and_gradients(chunk, two):
    """Chunks of ``chunk`` tokens over B = 3 rows: 3, 6, 9 take every row and 1, 2, 3 columns; 1 and 2 split the
    rows too. A float64 head computes its log-softmax in float64 (the log-prob contract), so every split agrees with
    the full path to float64 round-off (1e-10)."""
    tol = TOL
    h, w, b, y, m, refs, cot = _head_inputs()
    ref = _ref(refs, m, two)
    T = 0.7
    got, g_got = _grads(lambda: chunked_logprobs(h, w, b, y, chunk_size=chunk, temperature=T, with_entropy=True,
                                                 kl_reference=ref), h, w, b, cot)
    want, g_want = _grads(lambda: full_logprobs(torch.nn.functional.linear(h, w, b), y, temperature=T,
                                                with_entropy=True, kl_reference=ref), h, w, b, cot)
    for name, a, c in zip(("logp", "entropy", "kl"), got, want):
        _close(a, c, name, tol)
    for name, a, c in zip(("hidden", "weight", "bias"), g_got, g_want):
        _close(a, c, f"grad {name}", tol)
    assert got[0].dtype == torch.float64 and got[2][~m].abs().max() == 0  # the contract; no KL off the mask
    assert got[0].requires_grad and got[2].requires_grad and not got[1].requires_grad
    assert not chunked_logprobs(h, w, b, y, chunk_size=chunk, with_entropy=True)[1].requires_grad



@pytest.mark.parametrize("chunk", [1, 2, 3, 9])
def test_row_blocks_slice_rebuilt_and_recorded_parts(chunk):
    """A reference of two parts, rows 0 and 2 rebuilt from a head (``HeadInput``) and row 1 recorded
    (``RecordedInput``), read by row blocks (chunk 1, 2: ``KLReference.rows``) or whole (3, 9): the same values and
    gradients as the stored [B, C, V] tensor they make up, to float64 round-off."""
    h, w, b, y, m, _, cot = _head_inputs()
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(h.shape[-1], w.shape[0], dtype=torch.float64)
    states = torch.randn(2, h.shape[1], h.shape[-1], generator=g, dtype=torch.float64)
    recorded = torch.log_softmax(torch.randn(1, h.shape[1], w.shape[0], generator=g, dtype=torch.float64), -1)
    with torch.no_grad():
        rebuilt = torch.log_softmax(head(states) / 0.9, -1)
    stored = torch.stack([rebuilt[0], recorded[0], rebuilt[1]])
    parts = TeacherForced((HeadInput(states, head, torch.tensor([0, 2]), 0.9),
                           RecordedInput(recorded, torch.tensor([1]))), 3)
    got, g_got = _grads(lambda: chunked_logprobs(h, w, b, y, chunk_size=chunk, kl_reference=KLReference((parts,), m)),
                        h, w, b, cot)
    want, g_want = _grads(lambda: chunked_logprobs(h, w, b, y, chunk_size=chunk,
                                                   kl_reference=KLReference((stored,), m)), h, w, b, cot)
    _close(got[2], want[2], "kl")
    for name, a, c in zip(("hidden", "weight", "bias"), g_got, g_want):
        _close(a, c, f"grad {name}")
    assert torch.equal(recorded, parts.parts[1].states)  # read, never written over

def test_chunked_head_against_float64_math():
    """Independent of both paths: log-softmax, entropy and KL written out in float64, to float64 round-off (the
    contract: float64 hidden states and head give float64 log-probs)."""
    h, w, b, y, m, refs, cot = _head_inputs(seed=3)
    T = 1.3
    logp, ent, kl = chunked_logprobs(h, w, b, y, chunk_size=2, temperature=T, with_entropy=True,
                                     kl_reference=KLReference((refs[0],), m))
    (logp * cot[0] + kl * cot[1]).sum().backward()
    h2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (h, w, b))
    z = (h2 @ w2.T + b2) / T
    lsm = z - z.logsumexp(-1, keepdim=True)
    p = lsm.exp()
    want_lp = lsm.gather(-1, y[..., None]).squeeze(-1)
    want_kl = torch.where(m, (p * (lsm - refs[0].double())).sum(-1), 0.0)
    (want_lp * cot[0] + want_kl * cot[1]).sum().backward()
    _close(logp, want_lp, "logp", 1e-12)
    _close(ent, -(p * lsm).sum(-1), "entropy", 1e-12)
    _close(kl, want_kl, "kl", 1e-12)
    for name, a, c in (("hidden", h.grad, h2.grad), ("weight", w.grad, w2.grad), ("bias", b.grad, b2.grad)):
        _close(a, c, f"grad {name}", 1e-12)


@pytest.mark.parametrize("with_kl", [False, True], ids=["entropy", "entropy+kl"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 9])
def test_entropy_gradient_equals_autograd_through_the_full_vocabulary_entropy(chunk, with_kl):
    """An entropy bonus (``entropy_grad``): the chunked head's entropy carries the gradient of H = −Σ_v p log p,
    p = softmax((h·Wᵀ + b) / T), with the log-prob's (and the KL's) beside it. Against autograd through the
    whole-vocabulary entropy written out in float64 (no code of the package), to float64 round-off, over chunks
    of 1, 2, 3 tokens (several chunks, row blocks for 1 and 2) and one chunk (9)."""
    h, w, b, y, m, refs, cot = _head_inputs(seed=4)
    g_ent = torch.randn(*y.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    T = 0.7
    ref = KLReference((refs[0],), m) if with_kl else None
    logp, ent, kl = chunked_logprobs(h, w, b, y, chunk_size=chunk, temperature=T, with_entropy=True,
                                     kl_reference=ref, entropy_grad=True)
    assert ent.requires_grad
    loss = (logp * cot[0]).sum() + (ent * g_ent).sum() + ((kl * cot[1]).sum() if with_kl else 0.0)
    loss.backward()
    h2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (h, w, b))
    z = (h2 @ w2.T + b2) / T
    lsm = z - z.logsumexp(-1, keepdim=True)
    p = lsm.exp()
    want_ent = -(p * lsm).sum(-1)
    want = (lsm.gather(-1, y[..., None]).squeeze(-1) * cot[0]).sum() + (want_ent * g_ent).sum()
    if with_kl:
        want = want + (torch.where(m, (p * (lsm - refs[0].double())).sum(-1), 0.0) * cot[1]).sum()
    want.backward()
    _close(ent, want_ent, "entropy", 1e-12)
    for name, a, c in (("hidden", h.grad, h2.grad), ("weight", w.grad, w2.grad), ("bias", b.grad, b2.grad)):
        _close(a, c, f"grad {name}", 1e-12)
    # the entropy's share is not negligible: without it the gradient is another
    h.grad = None
    (chunked_logprobs(h, w, b, y, chunk_size=chunk, temperature=T)[0] * cot[0]).sum().backward()
    assert float((h.grad - h2.grad).abs().max()) > 1e-3


@pytest.mark.parametrize("chunk", [2, 9])
def test_an_entropy_without_gradient_leaves_the_backward_bit_for_bit(chunk):
    """entropy_grad off (entropy_coef = 0): the entropy is a constant and the gradients are those of the log-probs
    alone, bit for bit (the same ops; the learner always asks for the entropy, for its metric)."""
    h, w, b, y, m, refs, cot = _head_inputs(seed=6, dtype=torch.float32)
    grads = []
    for kw in ({}, {"with_entropy": True}):
        for t in (h, w, b):
            t.grad = None
        out = chunked_logprobs(h, w, b, y, chunk_size=chunk, temperature=0.7, **kw)
        assert out[1] is None or not out[1].requires_grad
        (out[0] * cot[0]).sum().backward()
        grads.append([t.grad.clone() for t in (h, w, b)])
    assert all(torch.equal(a, c) for a, c in zip(*grads))


def test_flat_hidden_states_are_one_row():
    h, w, b, y, _, _, _ = _head_inputs(seed=4, B=1)
    flat, _, _ = chunked_logprobs(h[0], w, None, y[0], chunk_size=3)
    rows, _, _ = chunked_logprobs(h, w, None, y, chunk_size=3)
    assert flat.shape == (7,) and torch.equal(flat, rows[0])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(h, w, None, y, chunk_size=0)

# ---- a frozen head (LoRA): the hidden states' gradient formed in the forward -----------------------


class _Passes:
    """Counts the chunked head's products (``_head``) and its backward's recomputed-logit gradients."""

    def __init__(self, monkeypatch):
        self.head = self.recomputed = 0
        head, grad = cl._head, cl._logp_chunk_grad

        def count_head(*a):
            self.head += 1
            return head(*a)

        def count_grad(*a):
            self.recomputed += 1
            return grad(*a)

        monkeypatch.setattr(cl, "_head", count_head)
        monkeypatch.setattr(cl, "_logp_chunk_grad", count_grad)


@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 9])
def test_a_frozen_head_takes_the_hidden_gradient_from_the_forward(chunk, bias, T, monkeypatch):
    """Weight and bias without gradient (LoRA's frozen head): log-probs, entropy and the hidden states' gradient
    equal autograd through the full [B, C, V] logits to float64 round-off, and the backward runs no LM-head product
    (one per chunk in the forward, none after): the gradient g·(W_y − E_p[W])/T was formed in the forward."""
    h, w, b, y, _, _, cot = _head_inputs(seed=8)
    w, b = w.detach(), (b.detach() if bias else None)
    passes = _Passes(monkeypatch)
    logp, ent, _ = chunked_logprobs(h, w, b, y, chunk_size=chunk, temperature=T, with_entropy=True)
    forward_products = passes.head
    (g_got,) = torch.autograd.grad((logp * cot[0]).sum(), h)
    assert passes.head == forward_products == len(cl.token_spans(*y.shape, chunk)) and passes.recomputed == 0
    h2 = h.detach().clone().requires_grad_(True)
    want_lp, want_ent = full_logprobs(torch.nn.functional.linear(h2, w, b), y, temperature=T, with_entropy=True)
    (g_want,) = torch.autograd.grad((want_lp * cot[0]).sum(), h2)
    _close(logp, want_lp, "logp")
    _close(ent, want_ent, "entropy")
    _close(g_got, g_want, "grad hidden")
    assert not ent.requires_grad and float(g_want.abs().max()) > 0.1


@pytest.mark.parametrize("with_kl, entropy_grad", [(True, False), (False, True)], ids=["kl", "entropy-bonus"])
def test_a_frozen_head_with_a_kl_or_an_entropy_bonus_recomputes_its_logits(with_kl, entropy_grad, monkeypatch):
    """A KL or an entropy with gradient needs more than g·(W_y − E_p[W]): the backward recomputes each chunk's
    logits as for a trained head, and the hidden states' gradient still equals the full path's."""
    h, w, b, y, m, refs, cot = _head_inputs(seed=9)
    w, b = w.detach(), b.detach()
    ref = KLReference((refs[0],), m) if with_kl else None
    passes = _Passes(monkeypatch)
    logp, ent, kl = chunked_logprobs(h, w, b, y, chunk_size=2, temperature=0.7, with_entropy=True,
                                     kl_reference=ref, entropy_grad=entropy_grad)
    forward_products = passes.head
    extra = (kl * cot[1]).sum() if with_kl else (ent * cot[1]).sum()
    (g_got,) = torch.autograd.grad((logp * cot[0]).sum() + extra, h)
    assert passes.head == 2 * forward_products
    h2 = h.detach().clone().requires_grad_(True)
    out = full_logprobs(torch.nn.functional.linear(h2, w, b), y, temperature=0.7, with_entropy=True,
                        kl_reference=ref, entropy_grad=entropy_grad)
    extra = (out[2] * cot[1]).sum() if with_kl else (out[1] * cot[1]).sum()
    (g_want,) = torch.autograd.grad((out[0] * cot[0]).sum() + extra, h2)
    _close(g_got, g_want, "grad hidden")


def test_a_frozen_head_under_bf16_autocast_is_as_close_to_float64_as_the_full_path():
    """bf16-mixed on this CPU: the frozen head's expectation E_p[W] is one bf16 product, as the full path's
    backward multiplies its bf16 logit gradient through the head. Both hidden-state gradients are compared
    with float64 autograd through the full logits: the chunked one's error is within 1.5× the full path's
    (measured 1.02×; both come mostly from the forward's bf16 logits, which set p)."""
    g = torch.Generator().manual_seed(0)
    B, C, H, Vs = 4, 64, 64, 2000
    h0 = torch.randn(B, C, H, generator=g)
    w = torch.randn(Vs, H, generator=g) * 3 * H ** -0.5
    y = torch.randint(0, Vs, (B, C), generator=g)
    cot = torch.randn(B, C, generator=g)

    def grad(fn, dtype, autocast):
        h = h0.to(dtype).clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp = fn(h, w.to(dtype))
        return torch.autograd.grad((lp * cot.to(lp.dtype)).sum(), h)[0].double()

    full = lambda h, w_: full_logprobs(torch.nn.functional.linear(h, w_), y, temperature=0.8)[0]
    chunked = lambda h, w_: chunked_logprobs(h, w_, None, y, chunk_size=50, temperature=0.8)[0]
    want = grad(full, torch.float64, False)
    err = {name: float((grad(fn, torch.float32, True) - want).abs().max() / want.abs().max())
           for name, fn in (("full", full), ("chunked", chunked))}
    assert 1e-4 < err["full"] and err["chunked"] <= 1.5 * err["full"], err



# ---- the forwards on a model ---------------------------------------------------------------------


def _forward_grads(model, fn, packed, cot, **kw):
    model.zero_grad(set_to_none=True)
    out = fn(model, packed, with_entropy=True, **kw)
    loss = (out[0] * cot).sum() + (out[2].sum() if len(out) > 2 else 0.0)
    loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _rebuilt_anchors(packed):
    """Two ``TeacherForced`` distributions: one model for every row, and two models over alternate rows."""
    B = packed.response_mask.shape[0]
    even, odd = torch.arange(0, B, 2), torch.arange(1, B, 2)
    return (teacher_forced(packed, [(None, Teacher(_sharp_llama(11), 0.7))]),
            teacher_forced(packed, [(even, Teacher(_sharp_llama(12))), (odd, Teacher(_sharp_llama(13), 1.3))]))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fn", [response_logprobs, grouped_response_logprobs], ids=["plain", "shared"])
@pytest.mark.parametrize("with_kl", [None, "stored", "rebuilt"], ids=["logp", "kl-stored", "kl-rebuilt"])
def test_forward_chunked_equals_full(fn, tied, with_kl):
    model = _llama(tied)
    packed, full_b, full_p = _stored()
    m = packed.response_mask
    cot = torch.randn(m.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * m
    kw = dict(temperature=0.8)
    if with_kl:
        anchors = (full_b, full_p) if with_kl == "stored" else _rebuilt_anchors(packed)
        kw["kl_reference"] = KLReference(anchors, m, (torch.tensor(0.2).log(), torch.tensor(0.6).log()),
                                         torch.tensor(0.8).log())
    want, g_want = _forward_grads(model, fn, packed, cot, **kw)
    head = _HeadPositions(model)
    got, g_got = _forward_grads(model, fn, packed, cot, chunk_size=2, **kw)
    assert head.seen[-1] == 0  # the completion pass's head computed nothing: the chunked head did
    for name, a, c in zip(("logp", "entropy", "kl"), got, want):
        _close(a[m], c[m], name)
    for n, g in g_want.items():
        _close(g_got[n], g, f"grad {n}")
    assert max(float(g.abs().max()) for g in g_want.values()) > 1e-3
    if with_kl:
        assert float(got[2][m].detach().mean()) > 0.1  # the KL term is not negligible


@pytest.mark.parametrize("fn", [response_logprobs, grouped_response_logprobs], ids=["plain", "shared"])
def test_full_log_softmax_without_gradient_chunk_by_chunk(fn):
    model = _llama()
    packed = _batch().packed
    m = packed.response_mask
    with torch.no_grad():
        want = fn(model, packed, with_full=True, with_entropy=True)
        head = _HeadPositions(model)
        got = fn(model, packed, with_full=True, with_entropy=True, chunk_size=3)
    assert head.seen[-1] == 0
    for name, a, c in zip(("logp", "entropy", "full"), got, want):
        _close(a[m], c[m], name)


def test_a_model_the_chunked_head_cannot_serve_keeps_the_full_path():
    model = _llama()
    packed = _batch().packed
    want, _ = response_logprobs(model, packed)
    model.config.model_type = "not_a_llama"  # e.g. a head with logit soft-capping: no hidden-state shortcut
    head = _HeadPositions(model)
    got, _ = response_logprobs(model, packed, chunk_size=2)
    assert head.seen == [packed.response_mask.shape[1] + 1] and torch.equal(got, want)


def test_one_chunk_is_the_full_path_op_for_op():
    model = _llama()
    packed = _batch().packed
    head = _HeadPositions(model)
    got, _ = grouped_response_logprobs(model, packed, chunk_size=8 * 8)  # B · (C + 1) tokens: one chunk
    assert head.seen[-1] == 8  # C + 1 positions through the model's own head, as before chunking
    assert torch.equal(got, grouped_response_logprobs(model, packed)[0])


# ---- through the learner -------------------------------------------------------------------------

CASES = [("p3o", {"kl": "exact"}), ("p3o_two_anchor", {"kl": "exact"}), ("grpo", {}), ("p3o", {})]


_HEAD_CALLS: list[int] = []  # positions of every LM-head call in this process's learners


def _learn(objective, options, chunk, shared, micro=3, world=None, batch=None):
    model = _llama(tied=True)
    model.lm_head.register_forward_hook(lambda _m, _a, out: _HEAD_CALLS.append(out.shape[1]))
    learner = Learner(model, objective, options, micro_batch_size=micro, shared_prompt=shared,
                      logprob_chunk_size=chunk, world=world)
    learner.grad_clip = 1e9
    grads = sgd_recording_grads(learner, model)
    metrics = learner.train_on(batch if batch is not None else _batch())  # each rank takes its shard
    return grads, metrics


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "plain"])
@pytest.mark.parametrize("objective, options", CASES, ids=["p3o-exact", "two_anchor-exact", "grpo", "p3o-k3"])
def test_learner_step_chunked_equals_full(objective, options, shared):
    want, m_want = _learn(objective, options, None, shared)
    _HEAD_CALLS.clear()
    got, m_got = _learn(objective, options, 2, shared)
    assert 0 in _HEAD_CALLS
    for n, g in want.items():
        _close(got[n], g, f"{objective} grad {n}")
    for k in ("loss", "entropy", "ess", "kl_behavior"):
        if k in m_want:
            assert m_got[k] == pytest.approx(m_want[k], rel=TOL, abs=1e-300), k
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
    if options.get("kl") == "exact":
        assert m_want["kl_behavior"] > 0.1 and m_want["ess"] < 0.9  # the exact KL term carries weight

@pytest.mark.parametrize("shared", [True, False], ids=["shared", "plain"])
@pytest.mark.parametrize("objective, options", [("grpo", {}), ("p3o", {})], ids=["grpo", "p3o-k3"])
def test_learner_step_with_a_frozen_head_chunked_equals_full(objective, options, shared, monkeypatch):
    """LoRA's case: the tied head and embeddings frozen, the decoder trained. The chunked learner step's gradients
    equal the full path's to float64 round-off, and its backward recomputed no logits."""
    def frozen(model):
        model.lm_head.weight.requires_grad_(False)  # tied: the embeddings too
        return model

    monkeypatch.setitem(globals(), "_llama", lambda tied=False, seed=0, _f=_llama: frozen(_f(tied, seed)))
    want, m_want = _learn(objective, options, None, shared)
    passes = _Passes(monkeypatch)
    got, m_got = _learn(objective, options, 2, shared)
    assert passes.head > 0 and passes.recomputed == 0
    assert "lm_head.weight" not in want and "model.embed_tokens.weight" not in want and want
    for n, g in want.items():
        _close(got[n], g, f"{objective} grad {n}")
    assert m_got["loss"] == pytest.approx(m_want["loss"], rel=TOL, abs=1e-300)


def test_learner_refuses_a_chunk_size_below_one():
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        Learner(_llama(), "grpo", logprob_chunk_size=0)


# ---- data parallel: the chunked head under DDP ---------------------------------------------------

DDP_CASES = [("p3o", {"kl": "exact"}), ("grpo", {})]


def _ddp_grads(world: World, out_dir: Path) -> dict:
    res = {name: _learn(name, opts, 2, True, micro=2, world=world)[0] for name, opts in DDP_CASES}
    res["head_positions"] = _HEAD_CALLS
    return res


@pytest.mark.slow  # two spawned ranks: ~30 s on 2 busy cores; the default job's DDP path is tests/integration/test_parallel.py
def test_two_gloo_ranks_with_the_chunked_head_equal_one_process_on_the_full_path(tmp_path):
    ranks = two_gloo_ranks(_ddp_grads, tmp_path)
    assert all(0 in r.pop("head_positions") for r in ranks)  # the chunked head ran under DDP on both ranks
    for name, opts in DDP_CASES:
        want, _ = _learn(name, opts, None, True, micro=8)
        for rank in range(2):
            for n, g in want.items():
                _close(ranks[rank][name][n], g, f"{name} rank {rank} grad {n}")


# ---- the objective's per-token KL input ----------------------------------------------------------


def _objective_inputs(seed=5, B=2, T=4, Vs=6):
    g = torch.Generator().manual_seed(seed)
    z = (2 * torch.randn(B, T, Vs, generator=g, dtype=torch.float64)).requires_grad_(True)
    bf, pf = (torch.log_softmax(2 * torch.randn(B, T, Vs, generator=g, dtype=torch.float64), -1) for _ in range(2))
    idx = torch.randint(0, Vs, (B, T, 1), generator=g)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return z, bf, pf, idx, mask, adv


def test_p3o_takes_the_per_token_kl_in_place_of_the_full_inputs():
    z, bf, _, idx, mask, adv = _objective_inputs()
    p3o = objectives.get("p3o")
    out = {}
    for how in ("full", "per_token"):
        z.grad = None
        lpf = torch.log_softmax(z, -1)
        lp, blp = lpf.gather(-1, idx).squeeze(-1), bf.gather(-1, idx).squeeze(-1)
        if how == "full":
            o = p3o(lp, blp, adv, mask, kl="exact", logprobs_full=lpf, behavior_logprobs_full=bf)
        else:
            kl_t = (lpf.exp() * (lpf - bf)).sum(-1)  # KL(π_θ‖π_b) written out
            o = p3o(lp, blp, adv, mask, kl="exact", kl_exact=kl_t)
        o.loss.backward()
        out[how] = (o.metrics, z.grad.clone())
    assert out["full"][0]["kl_behavior"] > 0.1
    for k in ("loss", "kl_behavior", "kl_loss", "ess"):
        assert out["per_token"][0][k] == pytest.approx(out["full"][0][k], rel=1e-12), k
    _close(out["per_token"][1], out["full"][1], "grad", 1e-12)
    assert objectives.spec("p3o").takes_kl_exact and objectives.spec("p3o_two_anchor").takes_kl_exact
    assert not objectives.spec("grpo").takes_kl_exact


def test_p3o_kl_exact_refusals():
    z, bf, pf, idx, mask, adv = _objective_inputs()
    lpf = torch.log_softmax(z, -1)
    lp, blp, plp = (t.gather(-1, idx).squeeze(-1) for t in (lpf, bf, pf))
    kl_t = (lpf.exp() * (lpf - bf)).sum(-1)
    p3o, two = objectives.get("p3o"), objectives.get("p3o_two_anchor")
    with pytest.raises(ValueError, match="only used by kl='exact'"):
        p3o(lp, blp, adv, mask, kl="k3", kl_exact=kl_t)
    with pytest.raises(ValueError, match="not both"):
        p3o(lp, blp, adv, mask, kl="exact", kl_exact=kl_t, behavior_logprobs_full=bf)
    with pytest.raises(ValueError, match=r"\+inf at valid positions"):
        p3o(lp, blp, adv, mask, kl="exact", kl_exact=torch.where(mask, float("inf"), kl_t))
    with pytest.raises(ValueError, match="ess and ess_proximal"):
        two(lp, blp, adv, mask, proximal_logprobs=plp, kl="exact", kl_exact=kl_t)
    with pytest.raises(ValueError, match="kl_exact"):
        objectives.validate_options("p3o", {"kl_exact": 1.0}, supplied=("behavior_logprobs_full",))
