"""The learner's reference KL and entropy bonus (the objectives' ``ref_kl_coef`` and ``entropy_coef``).

References, none computed by the package: a separately loaded copy of the initial weights (transformers'
``from_pretrained``, log-softmax gathered at the tokens), and both penalties written out in float64 with autograd:
k3 = exp(ref − logp) − (ref − logp) − 1 per token (the objectives' default ``ref_kl``, ``objectives/kl.py``: with
x = logp − ref, expm1(−x) + x), and the entropy −Σ_v p log p over the whole vocabulary, both token means over the
optimizer batch (the default ``token_mean``).
"""

import copy

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.forward import pack
from trustbatch.trainer import Learner

from grad_probe import step_gradients
from llama_rows import _llama, _rows


def _batch(seed=0) -> TrainBatch:
    """16 rows of 4 prompts (shuffled), behaviour log-probs in [−5, −2], random advantages."""
    packed = pack(*_rows(seed + 1), pad_id=0)
    B, C = packed.response_mask.shape
    g = torch.Generator().manual_seed(seed)
    blp = torch.where(packed.response_mask, -torch.rand(B, C, generator=g, dtype=torch.float64) * 3 - 2, 0.0)
    return TrainBatch(packed, blp, torch.randn(B, generator=g, dtype=torch.float64))


def _logprobs(model, packed, grad=False):
    """(log π of the completion tokens [B, C], the whole log-softmax [B, C, V]) in float64, written out."""
    C = packed.response_mask.shape[1]
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids).logits[:, -C - 1:-1]
        lsm = torch.log_softmax(logits.double(), -1)
    return lsm.gather(-1, packed.input_ids[:, -C:, None]).squeeze(-1), lsm


@pytest.mark.parametrize("given", [False, True], ids=["default", "given"])
@pytest.mark.parametrize("chunk", [None, 3], ids=["full", "chunked"])
def test_reference_logprobs_are_the_initial_models_after_training(tmp_path, chunk, given):
    """After two rounds of updates the reference's log-probs are still those of the initial weights, loaded again
    independently, to float32 round-off; the policy's have moved. By default the learner copies the policy it is
    given; ``reference=`` takes a model loaded separately. Each micro-batch of ``train_on`` carries them per token,
    [B, C] (never [B, C, V])."""
    from transformers import AutoModelForCausalLM

    _llama(torch.float32).save_pretrained(tmp_path / "initial")
    load = lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "initial")  # noqa: E731
    policy = load()
    learner = Learner(policy, "grpo", {"ref_kl_coef": 0.04}, lr=3e-2, micro_batch_size=5, logprob_chunk_size=chunk,
                      reference=load() if given else None)
    batch = _batch()
    batch.behavior_logprobs = batch.behavior_logprobs.float()
    seen = []
    for _ in range(2):
        learner.train_on(batch, stop_before=lambda i, mini: seen.append(mini.ref_logprobs) and False)
    got = learner.reference_logprobs(batch)
    want, _ = _logprobs(load().eval(), batch.packed)
    m = batch.packed.response_mask
    assert got.shape == m.shape and got.dtype == torch.float32
    assert float((got.double() - want)[m].abs().max()) < 2e-6  # float32 log-probs near −4: a few ulps
    moved = float((learner.logprobs(batch).double() - want)[m].abs().max())
    assert moved > 1e-2, moved  # the policy trained: a reference that followed it would fail above
    assert all(r is not None and r.shape == (len(batch), m.shape[1]) for r in seen) and len(seen) == 2


def _learner_grads(model, reference, batch, chunk, **options):
    """One optimizer step's gradients (lr 0, no clip) of GRPO with ``options``, the batch in micro-batches of 5."""
    m = copy.deepcopy(model)
    learner = Learner(m, "grpo", options, lr=0.0, grad_clip=1e9, micro_batch_size=5, logprob_chunk_size=chunk,
                      reference=copy.deepcopy(reference))
    return step_gradients(learner, m, batch)


def _hand_grads(model, reference, batch, ref_kl_coef, entropy_coef):
    """∇ of (Σ_t ref_kl_coef·k3_t − entropy_coef·H_t) / N over the valid tokens, float64 autograd, written out."""
    m = copy.deepcopy(model)
    packed, mask = batch.packed, batch.packed.response_mask
    logp, lsm = _logprobs(m, packed, grad=True)
    ref, _ = _logprobs(reference, packed)
    x = ref - logp
    k3 = torch.exp(x) - x - 1.0
    ent = -(lsm.exp() * lsm).sum(-1)
    loss = (ref_kl_coef * k3 - entropy_coef * ent)[mask].sum() / mask.sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}, float(k3.detach()[mask].mean())


@pytest.mark.parametrize("coefs", [(0.5, 0.0), (0.0, 1.0), (0.5, 1.0)], ids=["ref_kl", "entropy", "both"])
@pytest.mark.parametrize("chunk", [None, 3], ids=["full", "chunked"])
def test_penalty_gradients_equal_float64_autograd(chunk, coefs):
    """With ref_kl_coef and/or entropy_coef the step's gradient is the GRPO gradient plus that of the hand-written
    penalties (float64 model: both sides float64, so to float64 round-off), on the full path and on the chunked
    head with several chunks, over 4 micro-batches with the shared-prompt forward. The reference is another model
    (the initial weights perturbed), so that k3 and its gradient are far from 0."""
    ref_kl_coef, entropy_coef = coefs
    model = _llama(torch.float64)
    reference = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    batch = _batch(seed=2)
    options = {k: v for k, v in (("ref_kl_coef", ref_kl_coef), ("entropy_coef", entropy_coef)) if v}
    with_penalty, metrics = _learner_grads(model, reference, batch, chunk, **options)
    without, _ = _learner_grads(model, reference, batch, chunk)
    want, k3_mean = _hand_grads(model, reference, batch, ref_kl_coef, entropy_coef)
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-3, scale
    for n in want:
        err = float((with_penalty[n] - without[n] - want[n]).abs().max())
        assert err <= 1e-9 * scale, f"{n}: max |diff| {err:.3g} vs scale {scale:.3g}"
    if ref_kl_coef:
        assert metrics["kl_ref"] == pytest.approx(k3_mean, rel=1e-9) and k3_mean > 1e-2
    else:
        assert "kl_ref" not in metrics


def test_no_reference_without_a_reference_kl_and_a_reference_of_another_vocabulary_is_refused():
    model = _llama(torch.float32)
    assert Learner(model, "grpo", {"entropy_coef": 0.01}).reference is None  # no copy of the weights unless used
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=41, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="41 output logits, the policy 40"):
        Learner(model, "grpo", {"ref_kl_coef": 0.04}, reference=other)
