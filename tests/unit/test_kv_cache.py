"""The cache keyword and output field are read from the model: transformers renamed both in 5.24.

Before the port, a transformers 5.24 model's forward showed ``cache`` (not ``past_key_values``) and its
output had ``.cache``, so the shared-prompt forward and prefill-once generation fell back to their plain
paths without a word; these tests fail on 5.24 without the port.
"""

import functools
import types

import pytest
import torch
import transformers
from packaging.version import Version

from trustbatch.policy.kv_cache import cache_kwarg, output_cache
from trustbatch.policy.shared_prompt import shared_prompt_unsupported


def _module(forward):
    m = torch.nn.Module()
    m.forward = types.MethodType(forward, m)
    return m


def test_the_keyword_is_read_from_the_signature():
    assert cache_kwarg(_module(lambda self, input_ids, cache=None: None)) == "cache"
    assert cache_kwarg(_module(lambda self, input_ids, past_key_values=None: None)) == "past_key_values"
    assert cache_kwarg(_module(lambda self, input_ids, cache=None, past_key_values=None: None)) == "cache"
    assert cache_kwarg(_module(lambda self, input_ids: None)) is None

    # a renaming decorator in the style of transformers' deprecate_kwarg: functools.wraps exposes the new name
    def renamed(fn):
        @functools.wraps(fn)
        def wrapper(*a, past_key_values=None, **kw):
            return fn(*a, cache=past_key_values, **kw)
        return wrapper

    assert cache_kwarg(_module(renamed(lambda self, input_ids, cache=None: None))) == "cache"


def test_the_cache_is_found_under_either_output_name():
    c = object()
    assert output_cache(types.SimpleNamespace(cache=c)) is c
    assert output_cache(types.SimpleNamespace(past_key_values=c)) is c
    assert output_cache(types.SimpleNamespace(cache=None, past_key_values=c)) is c
    assert output_cache(types.SimpleNamespace(logits=1)) is None


def test_the_installed_transformers_llama_shares_its_prompt_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    renamed = Version(transformers.__version__).release >= (5, 24)  # the rename, from transformers' changelog
    assert cache_kwarg(model) == ("cache" if renamed else "past_key_values")
    assert shared_prompt_unsupported(model) is None
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert output_cache(out) is not None and output_cache(out).get_seq_length() == 3


# GrowingCache: appending into spare room must give exactly the numbers torch.cat gives.

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from trustbatch.policy.kv_cache import GrowingCache, GrowingLayer, growing_cache_fits  # noqa: E402
from trustbatch.rollout import SamplingParams, TransformersEngine  # noqa: E402
import trustbatch.rollout.transformers_engine as engine_module  # noqa: E402


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _kv(g, b, n):
    return torch.randn(b, 2, n, 3, generator=g), torch.randn(b, 2, n, 3, generator=g)


def test_growing_layer_holds_what_concatenation_holds():
    g = torch.Generator().manual_seed(0)
    for reserve in (0, 7, 100):  # 0 and 7: several reallocations (doubling); 100: none
        layer, ref_k, ref_v = GrowingLayer(reserve), None, None
        for step, n in enumerate([5, 1, 1, 3, 1, 1, 1, 1, 1, 1, 4, 1, 1]):
            k, v = _kv(g, 3, n)
            ref_k = k if ref_k is None else torch.cat([ref_k, k], dim=-2)
            ref_v = v if ref_v is None else torch.cat([ref_v, v], dim=-2)
            ok, ov = layer.update(k, v)
            assert torch.equal(ok, ref_k) and torch.equal(ov, ref_v), (reserve, step)
            assert layer.get_seq_length() == ref_k.shape[-2]
        # batch selection (prefill-once copies a prompt's cache to its rows), then more tokens
        idx = torch.tensor([2, 0, 0, 1])
        layer.batch_select_indices(idx)
        ref_k, ref_v = ref_k[idx], ref_v[idx]
        # crop keeps the buffer; the next token overwrites the cropped position
        layer.crop(-2)
        ref_k, ref_v = ref_k[..., :-2, :], ref_v[..., :-2, :]
        for n in (1, 1, 2):
            k, v = _kv(g, 4, n)
            ref_k, ref_v = torch.cat([ref_k, k], dim=-2), torch.cat([ref_v, v], dim=-2)
            ok, ov = layer.update(k, v)
            assert torch.equal(ok, ref_k) and torch.equal(ov, ref_v), reserve


def test_generate_with_a_growing_cache_equals_generate_with_its_own_cache():
    """transformers' own generate (default DynamicCache) is the reference: sequences and every step's scores
    equal bit for bit, on a left-padded batch with grouped-query attention."""
    model = _tiny_llama()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [0, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4]])
    att = (ids != 0).long()
    kw = dict(input_ids=ids, attention_mask=att, max_new_tokens=12, do_sample=False, top_k=None, top_p=None,
              temperature=None, pad_token_id=0, eos_token_id=2, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(**kw)
    out = model.generate(**kw, **{cache_kwarg(model): GrowingCache(reserve=8)})
    assert isinstance(output_cache(out), GrowingCache)  # generate kept the cache it was given
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores)) and len(out.scores) == len(ref.scores)


@pytest.mark.parametrize("prefill_once,precision", [(True, "float32"), (False, "float32"), (False, "fp8_e4m3")])
def test_the_engine_samples_the_same_with_and_without_the_growing_cache(monkeypatch, prefill_once, precision):
    model = _tiny_llama(1)
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 3, 3, 3, 3, 3, 4]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10)

    def sample():
        eng = TransformersEngine(model, 2, 0, precision=precision, share=precision == "float32",
                                 prefill_once=prefill_once)
        return eng.generate(prompts, 4, sp, seeds=[11, 12, 13])

    grown = sample()
    monkeypatch.setattr(engine_module, "growing_cache_fits", lambda m: False)
    plain = sample()
    assert [r.completion_ids for r in grown] == [r.completion_ids for r in plain]
    assert [r.behavior_logprobs for r in grown] == [r.behavior_logprobs for r in plain]
    assert sum(len(r.completion_ids) for r in grown) > 3 * 4 * 3  # sampled, not stopped at once


def test_growing_cache_fits_full_attention_only():
    assert growing_cache_fits(_tiny_llama())
    mistral = MistralForCausalLM(MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=4))
    assert not growing_cache_fits(mistral)
    static = _tiny_llama()
    static.generation_config.cache_implementation = "static"  # the engine's generate runs without it
    assert growing_cache_fits(static)
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))
    assert not growing_cache_fits(t5)
    assert not growing_cache_fits(torch.nn.Linear(2, 2))
