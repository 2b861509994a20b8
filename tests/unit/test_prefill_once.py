"""Prefill once in generation: the engine's samples and behaviour log-probs equal the plain path's.

The reference is the same engine with ``prefill_once=False`` (every row's prompt run by
``generate`` itself), on the same seeds: float64 log-probs to 1e-9 and float32 to 1e-5, tokens
identical. A forward hook records the batch shapes the model saw, so a prefill-once engine that
silently fell back to the plain path fails the test instead of passing it trivially.
"""

from contextlib import contextmanager

import pytest
import torch

from trustbatch.policy import load_policy
from trustbatch.rollout import SamplingParams, TransformersEngine
from trustbatch.rollout import transformers_engine as engine_module
from trustbatch.rollout.shifts import batch_scaled_linears

TEXTS = ("Once upon a time", "Lily saw a big dog", "Tom", "The sun was shining and the birds sang in the tree")


@pytest.fixture(scope="module")
def stories(shared_dir):
    return load_policy(shared_dir / "models" / "stories260K-hf")


@contextmanager
def model_in(policy, dtype):
    """The policy's module cast to ``dtype`` (eval mode), cast back to float32 afterwards: it is module-scoped."""
    try:
        yield policy.model.to(dtype).eval()
    finally:
        policy.model.float()


def first_forward_shapes(model, run):
    """Run ``run()`` and return the input_ids shape of each forward call of ``model``."""
    shapes = []
    h = model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        out = run()
    finally:
        h.remove()
    return out, shapes


def both(model, policy, prompts, n, sp, seeds, **kw):
    """(plain rollouts, prefill-once rollouts, the prefill-once engine's forward shapes)."""
    plain = TransformersEngine(model, policy.eos_id, policy.pad_id, prefill_once=False, **kw)
    once = TransformersEngine(model, policy.eos_id, policy.pad_id, prefill_once=True, **kw)
    a = plain.generate(prompts, n, sp, seeds=seeds)
    b, shapes = first_forward_shapes(model, lambda: once.generate(prompts, n, sp, seeds=seeds))
    return a, b, shapes


def assert_same(a, b, tol):
    assert [r.prompt_index for r in a] == [r.prompt_index for r in b]
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.truncated for r in a] == [r.truncated for r in b]
    worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.behavior_logprobs, rb.behavior_logprobs))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_same_tokens_and_logprobs_as_the_plain_path(stories, dtype, tol, temperature, top_p):
    with model_in(stories, dtype) as model:
        prompts = [stories.encode_prompt(t) for t in TEXTS]  # lengths differ: left padding within the chunk
        lens = [len(p) for p in prompts]
        assert len(set(lens)) == len(lens)
        sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10)
        a, b, shapes = both(model, stories, prompts, 5, sp, seeds=[11, 12, 13, 14])
        # the prefill ran each distinct prompt once, without its last token; generate then fed one token per row
        assert shapes[0] == (len(prompts), max(lens) - 1)
        assert shapes[1] == (5 * len(prompts), 1)
        worst = assert_same(a, b, tol)
        print(f"\n{dtype} T={temperature} top_p={top_p}: max |Δ logprob| {worst:.1e}")
        # the rows differ from each other: the test compares real samples, not one repeated sequence
        assert len({tuple(r.completion_ids) for r in a}) > len(prompts)


def test_chunks_that_split_groups_and_repeated_prompts(stories):
    """batch_size 7 with groups of 4: chunks hold parts of groups; a prompt given twice is prefilled once."""
    with model_in(stories, torch.float64) as model:
        p = [stories.encode_prompt(t) for t in TEXTS]
        prompts = [p[0], p[0], p[1], p[3]]
        sp = SamplingParams(temperature=1.0, max_new_tokens=8)
        a, b, shapes = both(model, stories, prompts, 4, sp, seeds=[1, 2, 3, 4], batch_size=7)
        assert_same(a, b, 1e-9)
        prefills = [s[0] for s in shapes if s[1] > 1]
        # rows 0-6: prompts 0 and 1, the same text (1 distinct); rows 7-13: prompts 1, 2, 3 (3); rows 14-15: prompt 3 (1)
        assert prefills == [1, 3, 1]


def test_greedy_and_single_samples(stories):
    with model_in(stories, torch.float64) as model:
        prompts = [stories.encode_prompt(t) for t in TEXTS]
        a, b, _ = both(model, stories, prompts, 3, SamplingParams(greedy=True, max_new_tokens=8), seeds=None)
        assert_same(a, b, 1e-9)
        # n = 1: no prompt repeats, so nothing to share: the plain path runs (its first forward has every row)
        a, b, shapes = both(model, stories, prompts, 1, SamplingParams(max_new_tokens=6), seeds=[5, 6, 7, 8])
        assert_same(a, b, 1e-9)
        assert shapes[0] == (len(prompts), max(len(p) for p in prompts))


def test_one_token_prompts_use_the_plain_path(stories):
    sp = SamplingParams(max_new_tokens=5)
    a, b, shapes = both(stories.model, stories, [[stories.eos_id + 1], [stories.eos_id + 2]], 3, sp, seeds=[1, 2])
    assert_same(a, b, 0.0)
    assert shapes[0] == (6, 1)


def test_int8_keeps_the_plain_path(stories):
    """int8 scales activations over the whole batch inside torch's kernels, so sharing a prefill would change its distribution."""
    assert TransformersEngine(stories.model, stories.eos_id, stories.pad_id, precision="int8").prefill_once is False
    assert TransformersEngine(stories.model, stories.eos_id, stories.pad_id).prefill_once is True
    assert TransformersEngine(stories.model, stories.eos_id, stories.pad_id, precision="fp8_e4m3").prefill_once is True


@pytest.mark.parametrize("reuse", [True, False])
def test_per_tensor_fp8_prefills_once_with_the_whole_forwards_scales(stories, monkeypatch, reuse):
    """Per-tensor FP8 prefill-once samples what the plain path samples, because each layer's activation scale is
    taken from the whole prompts and reused by the prefill and the last-token step. Without the reuse (each
    piece scaled by its own absmax, ``reuse=False``) the log-probs move by far more than round-off: what makes
    this test able to fail."""
    if not reuse:
        monkeypatch.setattr(engine_module, "batch_scaled_linears", lambda model: [])
    prompts = [stories.encode_prompt(t) for t in TEXTS]
    lens = [len(p) for p in prompts]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10)
    plain = TransformersEngine(stories.model, stories.eos_id, stories.pad_id, precision="fp8_e4m3", prefill_once=False)
    once = TransformersEngine(stories.model, stories.eos_id, stories.pad_id, precision="fp8_e4m3")
    a = plain.generate(prompts, 5, sp, seeds=[11, 12, 13, 14])
    b, shapes = first_forward_shapes(once.model, lambda: once.generate(prompts, 5, sp, seeds=[11, 12, 13, 14]))
    if reuse:
        # the scale pass over the whole distinct prompts, the prefill without their last token, then one token a row
        assert shapes[:3] == [(len(prompts), max(lens)), (len(prompts), max(lens) - 1), (5 * len(prompts), 1)]
        assert_same(a, b, 1e-5)
        assert not any(m._next_amax is not None for m in batch_scaled_linears(once.model))  # nothing left pending
    else:
        assert shapes[:2] == [(len(prompts), max(lens) - 1), (5 * len(prompts), 1)]
        worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.behavior_logprobs, rb.behavior_logprobs))
        assert worst > 1e-3, worst


def test_a_recurrent_model_samples_on_the_plain_path():
    """A recurrent (stateful) cache cannot be indexed out to the rows: Mamba's prefill-once stopped with
    "'LinearAttentionLayer' object has no attribute 'batch_select_indices'". It takes the plain path, whose
    behaviour log-probs are a float64 forward's of each row alone."""
    import copy

    from transformers import AutoModelForCausalLM, MambaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2,
                                                         pad_token_id=0, initializer_range=0.3)).eval()
    m64 = copy.deepcopy(model).double()
    out = TransformersEngine(model, 2, 0).generate([[5, 6, 7, 8, 9, 10], [11, 12]], 3, SamplingParams(max_new_tokens=6),
                                                  seeds=[1, 2])
    assert len(out) == 6
    for r in out:
        p, c = r.prompt_ids, r.completion_ids
        with torch.no_grad():
            want = torch.log_softmax(m64(input_ids=torch.tensor([p + c])).logits[0], -1)[len(p) - 1:len(p) + len(c) - 1]
        got = torch.tensor(r.behavior_logprobs, dtype=torch.float64)
        assert (want.gather(-1, torch.tensor(c)[:, None])[:, 0] - got).abs().max() <= 1e-5
