"""The transformers engine's sampler: Gumbel-max with one stream per completion (either kind, rollout.gumbel).

It must draw from softmax(processed logits) (checked by frequency against the model's own
distribution), and a completion must depend only on its seed, prompt and weights (not on the batch).
"""

import pytest
import torch

from trustbatch.rollout import SamplingParams, TransformersEngine


@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, eos_token_id=1, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # a peaked, non-uniform next-token distribution
    return m


@pytest.mark.parametrize("noise", ["generator", "philox"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_first_tokens_follow_the_processed_distribution(tiny_lm, temperature, top_p, noise):
    prompt = [2, 5, 7]
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([prompt])).logits[0, -1].double() / temperature
    p = torch.softmax(logits, -1)
    if top_p < 1.0:  # keep the smallest set of most likely tokens with mass >= top_p (HF's TopPLogitsWarper)
        order = torch.argsort(p, descending=True)
        keep = torch.zeros_like(p, dtype=torch.bool)
        mass = 0.0
        for i in order.tolist():
            keep[i] = True
            mass += float(p[i])
            if mass >= top_p:
                break
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    eng = TransformersEngine(tiny_lm, eos_id=1, pad_id=0, noise=noise)
    n = 4000
    ro = eng.generate([prompt], n, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=1), seeds=[11])
    counts = torch.bincount(torch.tensor([r.completion_ids[0] for r in ro]), minlength=12).double()
    # every sampled token is allowed, and the frequencies are within 5 standard errors of p
    assert all(p[t] > 0 for t in counts.nonzero().flatten().tolist())
    se = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= 5 * se + 1e-3).all(), (counts / n, p)
    # the recorded behaviour log-prob is log p of the sampled token
    for r in ro[:50]:
        assert abs(r.behavior_logprobs[0] - float(p[r.completion_ids[0]].log())) < 1e-4


def test_a_group_does_not_depend_on_the_rest_of_the_batch(tiny_lm):
    eng = TransformersEngine(tiny_lm, eos_id=1, pad_id=0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    alone = eng.generate([[2, 5, 7]], 4, sp, seeds=[123])
    mixed = eng.generate([[3, 3, 3, 3, 3, 4], [2, 5, 7], [9]], 4, sp, seeds=[1, 123, 2])[4:8]
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in mixed]
    for a, b in zip(alone, mixed):
        assert max(abs(x - y) for x, y in zip(a.behavior_logprobs, b.behavior_logprobs)) < 1e-5
    other = eng.generate([[2, 5, 7]], 4, sp, seeds=[124])
    assert [r.completion_ids for r in other] != [r.completion_ids for r in alone]  # the seed matters


def test_an_integer_or_numpy_temperature_samples_as_its_float(tiny_lm):
    """transformers' TemperatureLogitsWarper takes a Python float alone: SamplingParams(temperature=2) failed in the
    engine as "not strictly positive"; the vLLM engine and the config took it."""
    import numpy as np

    eng = TransformersEngine(tiny_lm, eos_id=1, pad_id=0)
    want = eng.generate([[2, 5, 7]], 2, SamplingParams(temperature=2.0, top_p=1.0, max_new_tokens=4), seeds=[5])
    for t, p in ((2, 1), (np.float32(2.0), np.float64(1.0))):
        got = eng.generate([[2, 5, 7]], 2, SamplingParams(temperature=t, top_p=p, max_new_tokens=4), seeds=[5])
        assert [(r.completion_ids, r.behavior_logprobs) for r in got] == \
            [(r.completion_ids, r.behavior_logprobs) for r in want]
