"""The learner's batch-scope ESS over micro-batches gives the single-batch update."""

import copy

import pytest
import torch

from trustbatch.policy.forward import pack
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.trainer import Learner, TrainBatch

from llama_rows import learner_batch as _batch


@pytest.fixture(scope="module")
def tiny():
    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3", "State the answer"], vocab_size=300)
    model = build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=32, seed=0, tokenizer=tok).double()
    return tok, model


def _grads(model, batch, micro, objective="p3o"):
    m = copy.deepcopy(model)
    learner = Learner(m, objective, micro_batch_size=micro, lr=0.0)
    learner.optimizer.step = lambda: None  # keep the gradients for the comparison
    learner.optimizer.zero_grad = lambda **k: None
    metrics = learner.step(batch)
    return {n: p.grad.clone() for n, p in m.named_parameters()}, metrics


def test_micro_batches_give_the_single_batch_gradient(tiny):
    tok, model = tiny
    b = _batch(tok)
    b.behavior_logprobs = b.behavior_logprobs.double()
    g_full, m_full = _grads(model, b, micro=6)
    for micro in (1, 2, 4):
        g, m = _grads(model, b, micro=micro)
        assert m["ess"] == pytest.approx(m_full["ess"], rel=1e-9)
        assert m_full["ess"] < 0.9  # off-policy enough for the ESS to matter
        for n in g_full:
            torch.testing.assert_close(g[n], g_full[n], rtol=1e-6, atol=1e-9)


def test_cap_weight_removed_is_the_batch_ratio_over_micro_batches(tiny):
    """Σ|A|·(ρ − min(ρ, e_B)) / Σ|A|·ρ over the whole batch, whatever the micro-batching, including a micro-batch
    whose advantages are all 0 (it adds nothing to either sum), against the sums written out from a plain forward."""
    from trustbatch.policy.forward import response_logprobs

    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    b.advantages = b.advantages.double()
    b.advantages[:2] = 0.0  # with micro=2 the first micro-batch has no advantage at all
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.packed)
    m = b.packed.response_mask
    rho = (logp - b.behavior_logprobs).exp()[m]
    e = float(rho.sum() ** 2 / (rho.numel() * (rho * rho).sum()))  # Eq. 11, normalized ESS
    a = b.advantages[:, None].expand_as(logp)[m].abs()
    want = float(((rho - rho.clamp(max=e)) * a).sum() / (rho * a).sum())
    assert 0.01 < want < 0.99  # the cap does something, and not everything
    for micro in (6, 2, 1):
        _, metrics = _grads(model, b, micro=micro)
        assert metrics["cap_weight_removed"] == pytest.approx(want, rel=1e-6), micro  # ρ is float32 in the objective
