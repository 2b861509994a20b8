"""Memory budgets in tokens × V: no LM-head chunk and no generate call holds more than 256 MiB of float32 [tokens, V]
scores, whatever the batch's rows B and completion width C (scale-up design, invariant 7).

The budget is checked against arithmetic written here (2^28 bytes / (4 bytes · V)), and by recording the shape of
every LM-head product the learner and the engine actually compute at V = 151,936 (Qwen2.5's vocabulary).
"""

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy import chunked_logprobs as cl
from trustbatch.policy.budget import generate_rows, logit_tokens
from trustbatch.policy.forward import pack
from trustbatch.rollout.engine import SamplingParams
from trustbatch.rollout.transformers_engine import TransformersEngine
from trustbatch.trainer import Learner

BUDGET = 256 * 2**20  # bytes of float32 logits per chunk
QWEN_V = 151_936


@pytest.mark.parametrize("V", [304, 32_000, QWEN_V, 262_144])
def test_chunks_tile_the_batch_under_the_budget(V):
    tokens = logit_tokens(V)
    assert tokens == BUDGET // (4 * V) and (V != QWEN_V or tokens == 441)
    for B in (1, 3, 8, 64, 440, 441, 442, 512, 1000):
        for C in (1, 7, 256, 1024, 4096):
            seen = torch.zeros(B, C, dtype=torch.int32)
            for rows, cols in cl.token_spans(B, C, tokens):
                n = (rows.stop - rows.start) * (cols.stop - cols.start)
                assert 0 < n and n * V * 4 <= BUDGET, (B, C, V, n)
                seen[rows, cols] += 1
            assert bool((seen == 1).all()), (B, C, V)  # every position once
            # the forwards take the full path only where its B · (C + 1) positions of logits fit
            assert cl.fits_one_chunk(B, C, tokens) == (B * (C + 1) * V * 4 <= BUDGET)


def _qwen(V=QWEN_V, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


class _HeadTokens:
    """The positions of every LM-head product: the model's own head (full path) and the chunked head's."""

    def __init__(self, model, monkeypatch):
        self.seen = []
        model.lm_head.register_forward_hook(lambda _m, _a, out: self.seen.append(out.numel() // out.shape[-1]))
        head = cl._head

        def spy(h, weight, bias):
            z = head(h, weight, bias)
            self.seen.append(z.numel() // z.shape[-1])
            return z

        monkeypatch.setattr(cl, "_head", spy)


def _batch(B, C, prompts, V=QWEN_V, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (prompts,), generator=g)]
    comps = [torch.randint(3, V, (C if i == 0 else int(torch.randint(1, C + 1, (1,), generator=g)),),
                           generator=g).tolist() for i in range(B)]
    packed = pack([ps[i % prompts] for i in range(B)], comps, 0)
    blp = torch.where(packed.response_mask, -torch.rand(B, C, generator=g) - 11.0, 0.0)
    return TrainBatch(packed, blp, torch.randn(B, generator=g))


@pytest.mark.parametrize("B, C, prompts", [(2, 100, 1), (8, 100, 2), (900, 2, 450)],
                         ids=["full-path", "columns", "row-blocks"])
def test_learner_default_chunks_stay_under_the_budget(B, C, prompts, monkeypatch):
    """The learner with its default chunking (micro-batches of 1,024 rows: the whole batch) at V = 151,936: every
    LM-head product, forward and backward, no-grad passes and the shared-prompt forward's prompt pass (450 prompts)
    included, holds at most 441 positions."""
    model = _qwen()
    heads = _HeadTokens(model, monkeypatch)
    learner = Learner(model, "p3o", micro_batch_size=1024)
    metrics = learner.step(_batch(B, C, prompts))
    assert heads.seen and max(heads.seen) * QWEN_V * 4 <= BUDGET, max(heads.seen)
    assert B * (C + 1) > 441 or max(heads.seen) == B * (C + 1)  # what fits in one chunk takes the full path
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def _engine_rollouts(model, monkeypatch, **kw):
    calls = []
    engine = TransformersEngine(model, eos_id=2, pad_id=0, **kw)
    chunk = engine._generate_chunk
    monkeypatch.setattr(engine, "_generate_chunk", lambda items, *a: calls.append(len(items)) or chunk(items, *a))
    out = engine.generate([[1, 5, 6], [1, 7], [1, 9, 10, 11]], 4, SamplingParams(max_new_tokens=6, temperature=1.0),
                          seeds=[11, 12, 13])
    return out, calls


def test_engine_generate_calls_are_bounded_and_split_changes_only_round_off(monkeypatch):
    """A logits budget of 5 rows of V = 304 splits 12 sequences into calls of 5, 5, 2 (independent arithmetic:
    ⌊5 · 304 · 4 / (4 · 304)⌋); the completions are the one-call ones (each keeps its own random stream) and the
    log-probs equal them to float32 round-off. A budget that holds every row gives today's single call."""
    model = _qwen(V=304).eval()
    whole, calls = _engine_rollouts(model, monkeypatch)
    assert calls == [12]
    split, calls = _engine_rollouts(model, monkeypatch, logits_bytes=5 * 304 * 4)
    assert calls == [5, 5, 2]
    for a, b in zip(whole, split):
        assert (a.prompt_ids, a.completion_ids) == (b.prompt_ids, b.completion_ids)
        assert torch.allclose(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs), atol=1e-5, rtol=0)
    kv = 2 * 1 * 1 * 4 * 4  # 2 · layers · KV heads · head dim · float32 bytes per position
    _, calls = _engine_rollouts(model, monkeypatch, kv_bytes=3 * (4 + 6) * kv)  # 3 rows of prompt 4 + 6 new
    assert calls == [3, 3, 3, 3]


def test_engine_rows_at_the_qwen_shape():
    """At V = 151,936 a decoding step's [rows, V] float32 scores stay under 256 MiB: 441 rows, and fewer where the
    key/value cache of the 0.5B shape (24 layers · 2 KV heads · 64 dims · 2 · 4 bytes per position) passes 4 GiB."""
    model = _qwen()
    assert generate_rows(model, 300, max_rows=512) == 441
    model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim = 24, 2, 64
    per_position = 24 * 2 * 64 * 2 * 4
    assert generate_rows(model, 1280, max_rows=512) == 2**32 // (1280 * per_position) == 136
