"""The cache keyword and output field are read from the model: transformers renamed both in 5.24.

Before the port, a transformers 5.24 model's forward showed ``cache`` (not ``past_key_values``) and its
output had ``.cache``, so the shared-prompt forward and prefill-once generation fell back to their plain
paths without a word; these tests fail on 5.24 without the port.
"""

import functools
import types

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
