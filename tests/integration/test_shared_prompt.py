"""The shared-prompt learner forward gives the plain forward's log-probs and gradients.

References are independent of the code under test: every row run alone, unpadded, through the
model's own forward (float64 autograd), and the learner with ``shared_prompt=False``.

Float64 models here compute RMSNorm in float64 (tests/support/llama_rows.py says why).
"""

from pathlib import Path

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy import shared_prompt as sp
from trustbatch.policy.forward import pack, response_logprobs
from trustbatch.policy.shared_prompt import grouped_response_logprobs, shared_prompt_unsupported, split_prompts
from trustbatch.trainer.learner import Learner
from trustbatch.parallel import World

from gloo_ranks import two_gloo_ranks
from grad_probe import sgd_recording_grads
from llama_rows import G, PROMPT_LENS, TOL, _close, _llama, _rows

class _Calls:
    """Counts calls of the model's forward (the shared path makes two per micro-batch, the plain one)."""

    def __init__(self, model):
        self.n = 0
        self.h = model.register_forward_pre_hook(lambda *_: setattr(self, "n", self.n + 1))


def _reference(model, prompts, comps, weights):
    """Per-row log-probs (each row alone, no padding) and the gradient of Σ weights·log-probs."""
    model.zero_grad(set_to_none=True)
    lps, total = [], 0.0
    for p, c, w in zip(prompts, comps, weights):
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the log-prob contract
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        lps.append(lp.detach())
        total = total + (lp * w[-len(c):]).sum()
    total.backward()
    return lps, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_logprobs_and_gradient_equal_each_row_alone(dtype, padding):
    model = _llama(dtype)
    prompts, comps = _rows()
    packed = pack(prompts, comps, pad_id=0)
    B, C = packed.response_mask.shape
    weights = torch.randn(B, C, generator=torch.Generator().manual_seed(2), dtype=dtype)
    want_lp, want_grad = _reference(model, prompts, comps, weights)

    model.zero_grad(set_to_none=True)
    calls = _Calls(model)
    lp, ent = grouped_response_logprobs(model, packed, with_entropy=True, prompt_padding=padding)
    assert calls.n == 2  # one prompt pass, one completion pass
    assert lp.shape == (B, C) and ent.shape == (B, C) and bool(torch.isfinite(lp).all())
    (lp * weights * packed.response_mask).sum().backward()
    for i, c in enumerate(comps):
        _close(lp[i, C - len(c):], want_lp[i], f"log-probs row {i}", TOL[dtype])
    for n, g in want_grad.items():
        _close(model.get_parameter(n).grad, g, f"grad {n}", TOL[dtype])
    # the entropy is the plain forward's at every valid position
    _, want_ent = response_logprobs(model, packed, with_entropy=True)
    m = packed.response_mask
    _close(ent[m], want_ent[m], "entropy", TOL[dtype])


def test_the_split_shares_one_prefix_per_prompt():
    prompts, comps = _rows()
    s = split_prompts(pack(prompts, comps, pad_id=0))
    assert s.prefix_ids.shape == (len(PROMPT_LENS), max(PROMPT_LENS) - 1)
    assert sorted(s.prefix_len.tolist()) == sorted(n - 1 for n in PROMPT_LENS)
    for i, p in enumerate(prompts):  # every row points at its own prompt's prefix
        u = int(s.group[i])
        assert s.prefix_ids[u, :len(p) - 1].tolist() == p[:-1]
    assert s.saving > 0.3


def _batch(dtype, seed=1):
    prompts, comps = _rows(seed)
    packed = pack(prompts, comps, pad_id=0)
    B, C = packed.response_mask.shape
    g = torch.Generator().manual_seed(seed + 10)
    blp = -3.0 + 0.8 * torch.randn(B, C, generator=g, dtype=dtype)
    prox = blp + 0.3 * torch.randn(B, C, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)
    return TrainBatch(packed, blp, adv, torch.zeros(B, dtype=torch.long), proximal_logprobs=prox)


def _train_grads(objective, shared, micro_batch_size, dtype, world=None, batch=None):
    """Gradients of one ``train_on`` (proximal log-probs and batch statistics included), taken before the SGD step."""
    model = _llama(dtype)
    learner = Learner(model, objective, {}, lr=1e-2, grad_clip=1e9, micro_batch_size=micro_batch_size,
                      world=world, shared_prompt=shared)
    grads = sgd_recording_grads(learner, model)
    calls = _Calls(model)
    torch.manual_seed(5)  # the same row permutation in train_on
    learner.train_on(batch if batch is not None else _batch(dtype))
    return grads, calls.n


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("objective", ["p3o", "grpo", "p3o_two_anchor"])
@pytest.mark.parametrize("mbs", [16, 7, 3])  # one micro-batch; micro-batches that split groups (G=4)
def test_learner_gradient_equals_the_plain_forward(objective, mbs, dtype):
    want, plain_calls = _train_grads(objective, False, mbs, dtype)
    got, shared_calls = _train_grads(objective, True, mbs, dtype)
    assert shared_calls > plain_calls  # the shared path ran (two calls per micro-batch where it pays)
    for n in want:
        _close(got[n], want[n], f"{objective} mbs={mbs} {n}", TOL[dtype])
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3


def test_a_sliding_window_model_falls_back_to_the_plain_forward():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    model = MistralForCausalLM(cfg).double()
    assert "sliding" in shared_prompt_unsupported(model)
    packed = pack(*_rows(), pad_id=0)
    calls = _Calls(model)
    lp, _ = grouped_response_logprobs(model, packed)
    assert calls.n == 1
    assert torch.equal(lp, response_logprobs(model, packed)[0])


def test_a_model_without_a_cache_falls_back():
    class NoCache(torch.nn.Module):  # a causal LM that takes no past_key_values
        def __init__(self):
            super().__init__()
            self.inner = _llama()
            self.config = self.inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              logits_to_keep=logits_to_keep, use_cache=False)

    model = NoCache()
    assert "past_key_values" in shared_prompt_unsupported(model)
    packed = pack(*_rows(), pad_id=0)
    assert torch.equal(grouped_response_logprobs(model, packed)[0], response_logprobs(model, packed)[0])


def test_an_unexpected_cache_at_run_time_falls_back_and_is_remembered(monkeypatch):
    model = _llama()
    packed = pack(*_rows(), pad_id=0)
    monkeypatch.setattr(sp, "_is_plain_dynamic_cache", lambda cache: False)
    calls = _Calls(model)
    lp, _ = grouped_response_logprobs(model, packed)
    assert calls.n == 2  # the wasted prompt pass, then the plain forward
    assert torch.equal(lp, response_logprobs(model, packed)[0])
    assert "DynamicCache" in shared_prompt_unsupported(model)


def test_no_repeated_prompt_or_a_foreign_layout_takes_the_plain_forward():
    model = _llama()
    prompts, comps = _rows(g=1)
    calls = _Calls(model)
    grouped_response_logprobs(model, pack(prompts, comps, pad_id=0))
    assert calls.n == 1  # sharing would save nothing
    packed = pack(*_rows(), pad_id=0)
    packed.position_ids = packed.position_ids + 1  # not pack's positions: the split cannot trust the layout
    assert split_prompts(packed) is None


# ---- data parallel ------------------------------------------------------------------------------

def _ddp_grads(world: World, out_dir: Path) -> dict:
    batch = _batch(torch.float64)
    return {(obj, shared): _train_grads(obj, shared, 3, torch.float64, world=world, batch=batch)  # train_on shards
            for obj in ("p3o_two_anchor", "grpo") for shared in (False, True)}


def test_two_gloo_ranks_with_shared_prompts_equal_the_plain_data_parallel_step(tmp_path):
    """Under DDP the prompt pass bypasses the wrapper and the completion pass goes through it, once per backward."""
    ranks = two_gloo_ranks(_ddp_grads, tmp_path)
    for obj in ("p3o_two_anchor", "grpo"):
        one, _ = _train_grads(obj, False, 64, torch.float64)
        for rank in range(2):
            res = ranks[rank]
            want, got = res[(obj, False)][0], res[(obj, True)][0]
            for n in want:
                _close(got[n], want[n], f"{obj} rank {rank} {n}", 1e-9)
                # the plain data-parallel step itself differs from one process by ~1e-7 (p3o_two_anchor)
                _close(got[n], one[n], f"{obj} rank {rank} {n} vs one process", 1e-6)


def test_gather_rows_gradient_is_the_per_prompt_sum_and_index_selects_bit_for_bit():
    """``gather_rows`` against a loop that sums each prompt's rows in float64 (independent), and against
    ``index_select`` under autograd bit for bit, on strided keys as a cache holds them ([U, P, H, D] transposed)."""
    g = torch.Generator().manual_seed(3)
    U, B = 5, 23
    index = torch.randint(0, U - 1, (B,), generator=g)  # prompt U - 1 has no row: its gradient is zero
    base = torch.randn(U, 7, 2, 4, generator=g)
    grad = torch.randn(B, 7, 2, 4, generator=g).transpose(1, 2)  # a strided output gradient, as after a cat

    def run(gather):
        x = base.clone().requires_grad_()
        out = gather(x.transpose(1, 2), index)
        out.backward(grad)
        return out.detach(), x.grad

    got, got_grad = run(sp.gather_rows)
    want, want_grad = run(lambda x, i: x.index_select(0, i))
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    by_hand = torch.zeros(U, 2, 7, 4, dtype=torch.float64)
    for row, u in enumerate(index.tolist()):
        by_hand[u] += grad[row].double()
    torch.testing.assert_close(got_grad.transpose(1, 2).double(), by_hand, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_grad[U - 1], torch.zeros_like(got_grad[U - 1]))
