"""The static-cache decode loop (``rollout.decode=static``): the dynamic loop's samples, log-probs to round-off.

Reference: the same engine with ``decode="dynamic"`` (transformers' ``generate``) on the same model, prompts and
seeds. Both draw the same Gumbel noise from the same per-row streams, so every sampled token must be equal; the
log-probs may differ by float round-off only: the static loop's attention reduces over a fixed number of key
positions (the masked ones weigh exactly 0) and computes the last prompt token in its own step, which may group
sums differently. Tolerance, float32: ``TOL`` = 1e-5 absolute. Measured on this model: the two loops differ by
≤ 1.9e-6, while each loop's own float32 error against a float64 forward of the same samples is 3–4.4e-6 (the
logits pass through two layers of std-0.3 weights); 1e-5 is about twice that own error, and three orders below what
a wrong position or mask gives (the perturbation tests: > 1e-2 or other tokens). float64 model: 1e-9 (``generate``
casts each step's logits to float32, so both loops round the same float64 logits to float32: equal up to a rare
one-ulp tie).

The learner check: the static engine's behaviour log-probs against the float32 learner's (``Learner.logprobs``,
teacher forcing the whole sequence): on-policy ESS 1 within float32 round-off (1 − ESS ≈ Var(Δ log p) ~ 1e-12).
"""

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from trustbatch.errors import UserError
from trustbatch.rollout import EngineSpec, SamplingParams, TransformersEngine, check_engine
from trustbatch.rollout import static_decode

from peaked_llama import peaked_llama

TOL = 1e-5
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 3, 3, 3, 3, 3, 4], [1, 5, 6, 7, 8]]  # left padding; a repeated prompt
SEEDS = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def model():
    return peaked_llama(positions=128)


def sample(model, decode, sp, prompts=PROMPTS, seeds=SEEDS, n=4, **kw):
    return TransformersEngine(model, 2, 0, decode=decode, **kw).generate(prompts, n, sp, seeds=seeds)


def worst_difference(a, b) -> float:
    """Largest |Δ behaviour log-prob|; asserts the same prompts, tokens and truncation."""
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.truncated for r in a] == [r.truncated for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.behavior_logprobs, rb.behavior_logprobs))


def forward_shapes(model, run):
    """``run()``'s result and the input_ids shape of each forward of ``model`` during it."""
    shapes = []
    h = model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        return run(), shapes
    finally:
        h.remove()


@pytest.mark.parametrize("prefill_once", [True, False])
@pytest.mark.parametrize("temperature,top_p,greedy", [(1.0, 1.0, False), (0.7, 0.9, False), (1.0, 1.0, True)])
def test_static_samples_what_dynamic_samples(model, prefill_once, temperature, top_p, greedy):
    sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=20, greedy=greedy)
    dynamic = sample(model, "dynamic", sp, prefill_once=prefill_once)
    static, shapes = forward_shapes(model, lambda: sample(model, "static", sp, prefill_once=prefill_once))
    worst = worst_difference(dynamic, static)
    print(f"\nT={temperature} top_p={top_p} greedy={greedy} prefill_once={prefill_once}: max |Δ logprob| {worst:.1e}")
    assert worst <= TOL
    # the prefill ran the distinct prompts (or every row) without their last token, then one token per row per step
    assert shapes[0] == ((3 if prefill_once else 16), 6) and set(shapes[1:]) == {(16, 1)}
    ends = [r.truncated for r in static]
    assert any(ends) and not all(ends)  # EOS stopped some rows, the budget others
    if not greedy:
        assert len({tuple(r.completion_ids) for r in static}) > 3  # real samples, not one sequence per prompt


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_philox_noise_in_both_loops(model, decode):
    """noise="philox": the static loop samples what the dynamic loop samples with it; the samples are other than the
    generator streams' (another stream) and a group still depends only on its own seed."""
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20)
    philox = sample(model, decode, sp, noise="philox")
    assert worst_difference(sample(model, "dynamic", sp, noise="philox"), philox) <= TOL
    assert [r.completion_ids for r in philox] != [r.completion_ids for r in sample(model, decode, sp)]
    alone = TransformersEngine(model, 2, 0, decode=decode, noise="philox").generate([[1, 9]], 4, sp, seeds=[12])
    assert worst_difference(alone, philox[4:8]) <= TOL


def test_float64_static_samples_what_dynamic_samples(model):
    m = copy.deepcopy(model).double()
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20)
    assert worst_difference(sample(m, "dynamic", sp), sample(m, "static", sp)) <= 1e-9


def test_one_token_prompts_and_chunks(model):
    """One-token prompts (nothing to prefill: the first step allocates the cache) and a batch split in chunks, whose
    static chunks are made equal (12 rows at batch_size 5: 3 × 4 instead of 5 + 5 + 2) and reuse one cache."""
    sp = SamplingParams(max_new_tokens=12)
    prompts, seeds = [[1], [7], [9]], [3, 4, 5]
    dynamic = sample(model, "dynamic", sp, prompts, seeds, batch_size=5)
    static, shapes = forward_shapes(model, lambda: sample(model, "static", sp, prompts, seeds, batch_size=5))
    assert worst_difference(dynamic, static) <= TOL
    assert set(shapes) == {(4, 1)}


def test_recorded_distributions_at_bfloat16(model):
    """record=True (a bf16 behaviour copy, kl="exact"): each rollout carries the static loop's [len, V] log-softmax,
    whose values at the tokens are its behaviour log-probs exactly, and which is the dynamic loop's to bf16 round-off
    (unit round-off 2^-8 of logits up to ~10 here: ≤ 0.04 per step; asserted 0.1) on rows that sampled the same."""
    sp = SamplingParams(max_new_tokens=12)
    kw = dict(precision="bfloat16", share=False, record=True)
    dynamic, static = sample(model, "dynamic", sp, **kw), sample(model, "static", sp, **kw)
    same = [(a, b) for a, b in zip(dynamic, static) if a.completion_ids == b.completion_ids]
    assert len(same) >= len(static) // 2
    for r in static:
        full = r.behavior_logprobs_full
        assert full.shape == (len(r.completion_ids), 40) and full.dtype == torch.float32
        assert full.gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1).tolist() == r.behavior_logprobs
    assert max(float((a.behavior_logprobs_full - b.behavior_logprobs_full).abs().max()) for a, b in same) <= 0.1


def test_a_checkpointed_training_module(model):
    """The learner's module as a run hands it over (train mode, activation checkpointing on): the engine decodes it in
    eval mode, where checkpointing is off, so the static loop takes it and samples what the dynamic loop samples."""
    from trustbatch.policy.model import enable_activation_checkpointing

    m = copy.deepcopy(model)
    enable_activation_checkpointing(m)
    m.train()
    sp = SamplingParams(max_new_tokens=12)
    assert worst_difference(sample(m, "dynamic", sp), sample(m, "static", sp)) <= TOL
    assert m.training


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft calls it
def test_a_lora_module(model):
    """A peft LoRA wrapper (``model.lora`` on policy): the static loop decodes the transformers model inside it, whose
    layers carry the adapters, and samples what the wrapper's generate samples. The adapters' B is made non-zero,
    so a loop that bypassed them would sample other tokens (checked)."""
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(max_new_tokens=12)
    static = sample(lora, "static", sp)
    assert worst_difference(sample(lora, "dynamic", sp), static) <= TOL
    assert [r.completion_ids for r in static] != [r.completion_ids for r in sample(model, "static", sp)]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft calls it
@pytest.mark.parametrize("wrap", ["plain", "lora"])
@pytest.mark.parametrize("prefill_once", [True, False])
def test_the_models_generation_config_does_not_change_the_sampling(model, wrap, prefill_once):
    """An Instruct model's ``generation_config.json`` (a repetition penalty, top-k, its own cache) must not reach
    ``generate``: the dynamic loop samples what the static loop samples, and each recorded log-prob is
    log_softmax(logits / T) of the sampled token from a plain forward of prompt + completion."""
    m = copy.deepcopy(model)
    if wrap == "lora":
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    own = m.generation_config
    own.update(do_sample=True, repetition_penalty=1.5, top_k=2, no_repeat_ngram_size=2, cache_implementation="static")
    sp = SamplingParams(temperature=0.8, max_new_tokens=12)
    dynamic = sample(m, "dynamic", sp, prefill_once=prefill_once)
    assert worst_difference(dynamic, sample(m, "static", sp, prefill_once=prefill_once)) <= TOL
    assert m.generation_config is own and own.repetition_penalty == 1.5  # put back as it was
    worst = 0.0
    with torch.no_grad():
        for r in dynamic:
            seq = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = m(input_ids=seq).logits[0, len(r.prompt_ids) - 1:-1].double() / sp.temperature
            want = logits.log_softmax(-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            worst = max(worst, float((want - torch.tensor(r.behavior_logprobs, dtype=torch.float64)).abs().max()))
    assert worst <= TOL


def test_caches_are_kept_per_shape(model):
    """A chunk shape seen before gets its cache (and buffers) back, zeroed, so a CUDA graph sees the same addresses;
    at most KEEP shapes are held, the least recently used dropped first."""
    eng = TransformersEngine(model, 2, 0, decode="static")
    held = eng._static._held

    def run(tokens):
        eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=tokens), seeds=SEEDS)
        return next(reversed(held.values()))[0]

    first = run(10)  # 6 − 1 + 10 positions: the bucket of 64
    second = run(100)  # 128
    assert second is not first and run(10) is first and len(held) == 2
    run(150), run(250)  # two more buckets: the 128-position cache was used longest ago
    kept = [c for c, *_ in held.values()]
    assert len(kept) == static_decode.KEEP and first in kept and second not in kept


def test_a_group_does_not_depend_on_the_rest_of_the_batch(model):
    eng = TransformersEngine(model, 2, 0, decode="static")
    sp = SamplingParams(max_new_tokens=10)
    alone = eng.generate([[1, 9]], 4, sp, seeds=[12])
    mixed = eng.generate(PROMPTS, 4, sp, seeds=SEEDS)[4:8]
    assert worst_difference(alone, mixed) <= TOL


def _off_by_one_position(step):
    return lambda model, name, cache, ids, pos, *a: step(model, name, cache, ids, pos + 1, *a)


def _last_prompt_token_hidden(step):
    def run(model, name, cache, ids, pos, mask, *a):
        masked = mask.clone()
        masked[:, int(cache.get_seq_length())] = 0  # the column this step writes: the query cannot see itself
        return step(model, name, cache, ids, pos, masked, *a)
    return run


@pytest.mark.parametrize("perturb", [_off_by_one_position, _last_prompt_token_hidden])
def test_the_comparison_catches_a_wrong_position_or_mask(model, monkeypatch, perturb):
    """The tests above can fail: a decode step one position off, or one that hides the token it writes, samples
    other tokens or moves the log-probs far past TOL."""
    sp = SamplingParams(max_new_tokens=20)
    dynamic = sample(model, "dynamic", sp)
    monkeypatch.setattr(static_decode, "_step", perturb(static_decode._step))
    static = sample(model, "static", sp)
    tokens_differ = [r.completion_ids for r in dynamic] != [r.completion_ids for r in static]
    assert tokens_differ or worst_difference(dynamic, static) > 1e-2


def _on_policy_ess(model, decode, bf16=False, prompts=PROMPTS, seeds=SEEDS):
    """ESS of the learner's ratios on a batch the engine just sampled from the same module: float32, or the
    bf16-mixed learner against an engine under its bf16 autocast (``bf16``)."""
    from trustbatch.objectives import RatioStats
    from trustbatch.pipeline.batch import build_batch
    from trustbatch.trainer import Learner

    m = copy.deepcopy(model)
    learner = Learner(m, "grpo", precision="bf16-mixed" if bf16 else "float32")
    eng = TransformersEngine(m, 2, 0, decode=decode, autocast=torch.bfloat16 if bf16 else None)
    rollouts = eng.generate(prompts, 8, SamplingParams(max_new_tokens=16), seeds=seeds)
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), pad_id=0)
    logp = learner.logprobs(batch)
    return float(RatioStats.from_logprobs(logp, batch.behavior_logprobs, batch.packed.response_mask).ess()[0])


def test_on_policy_ess_is_one(model, monkeypatch):
    ess = _on_policy_ess(model, "static")
    assert 1.0 - ess < 1e-10, ess
    monkeypatch.setattr(static_decode, "_step", _off_by_one_position(static_decode._step))
    broken = _on_policy_ess(model, "static")
    assert 1.0 - broken > 1e-4, broken  # the ESS check can fail: a wrong position is far off-policy


@pytest.mark.slow
def test_compiled_samples_what_dynamic_samples(model):
    """``static_compiled`` on this CPU (inductor): one compiled graph for every step of both calls, the same samples;
    with noise="philox" a second graph computes the stream inside. The compiles take ~10 s (warm inductor cache) to
    ~60 s (cold) each on a shared 2-core CPU, hence slow."""
    torch._dynamo.reset()
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20)
    eng = TransformersEngine(model, 2, 0, decode="static_compiled")
    for _ in range(2):  # the second call reuses the cache and the graph
        assert worst_difference(sample(model, "dynamic", sp), eng.generate(PROMPTS, 4, sp, seeds=SEEDS)) <= TOL
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    philox = TransformersEngine(model, 2, 0, decode="static_compiled", noise="philox")  # the stream inside the graph
    reference = sample(model, "dynamic", sp, noise="philox")
    assert worst_difference(reference, philox.generate(PROMPTS, 4, sp, seeds=SEEDS)) <= TOL
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


@pytest.mark.slow
def test_compiled_bf16_autocast_stays_on_policy(monkeypatch):
    """Under the learner's bf16 autocast, ``static_compiled`` is no further off-policy than the eager loop: 1 − ESS
    against the bf16-mixed learner within 2× the dynamic loop's (measured 8.9e-5 against 7.4e-5 here). Inductor's
    fused kernels skip the bf16 roundings between ops unless ``emulate_precision_casts`` (``compile_options``);
    without it the same check fails (2.9e-4 here). Two compiles, hence slow."""
    m = peaked_llama(vocab=1000, hidden=128, positions=128)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (8,), generator=g)]
    off = {d: 1.0 - _on_policy_ess(m, d, bf16=True, prompts=prompts, seeds=list(range(8)))
           for d in ("dynamic", "static_compiled")}
    print(f"\nbf16 autocast, 1 - ESS: {off}")
    assert off["static_compiled"] <= 2 * off["dynamic"], off
    torch._dynamo.reset()
    monkeypatch.setattr(static_decode, "compile_options", lambda device: {})
    unrounded = 1.0 - _on_policy_ess(m, "static_compiled", bf16=True, prompts=prompts, seeds=list(range(8)))
    print(f"without emulate_precision_casts: {unrounded:.2e}")
    assert unrounded > 2 * off["dynamic"], (unrounded, off)


# Random123's published known answers for Philox4x32-10 (its tests/kat_vectors; also TensorFlow's
# stateful_random_ops_test): (counter, key, output words)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox_python(ctr, key):
    """Philox4x32-10 on Python integers (exact products, no splitting): the textbook definition."""
    (c0, c1, c2, c3), (k0, k1) = ctr, key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
    return c0, c1, c2, c3


def test_philox_matches_its_known_answers_and_the_integer_definition():
    from trustbatch.rollout.gumbel import philox4x32, philox_uniforms

    for ctr, key, want in PHILOX_KAT:
        got = philox4x32(tuple(torch.tensor(c) for c in ctr), tuple(torch.tensor(k) for k in key))
        assert tuple(int(w) for w in got) == want == _philox_python(ctr, key)
    # the engine's layout: row seed -> key, (token block, step, 0, 0) -> counter, word v % 4 -> token v
    seeds, step, V = [5, 2**62 + 7, 123456789], 3, 10
    u = philox_uniforms(torch.tensor(seeds), torch.tensor(step), V)
    for r, seed in enumerate(seeds):
        words = [w for b in range(3) for w in _philox_python((b, step, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))][:V]
        assert u[r].tolist() == [((w >> 9) + 0.5) / 2**23 for w in words]
    big = philox_uniforms(torch.arange(64) * 7919, 0, 4096)
    assert 0 < big.min() and big.max() < 1 and abs(big.mean().item() - 0.5) < 0.005  # 262,144 draws: se 5.6e-4


def test_generator_stream_draws_row_uniforms_on_several_threads():
    from trustbatch.rollout.gumbel import GeneratorStream, row_uniforms

    gens = [torch.Generator().manual_seed(s) for s in range(7)]
    stream = GeneratorStream(list(range(7)), 1000, "cpu", threads=3, min_parallel=0)
    assert stream.threads == 3
    assert all(torch.equal(stream.next(), row_uniforms(gens, 1000)) for _ in range(4))


def test_generator_stream_one_step_ahead_draws_row_uniforms(monkeypatch):
    """The CUDA path's double buffering (draw step t + 1 while step t is used), run on the CPU: the event a buffer
    waits for is faked, the order of the draws is what is checked."""
    from trustbatch.rollout import gumbel

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(gumbel.torch.cuda, "Event", Event)
    gens = [torch.Generator().manual_seed(s) for s in range(5)]
    stream = gumbel.GeneratorStream(list(range(5)), 300, "cpu", threads=2, min_parallel=0)
    stream._ahead = True
    for _ in range(5):
        assert torch.equal(stream.next(), gumbel.row_uniforms(gens, 300))


def test_refusals(model):
    with pytest.raises(ValueError, match="decode='bogus'"):
        TransformersEngine(model, 2, 0, decode="bogus")
    with pytest.raises(ValueError, match="int8"):
        TransformersEngine(model, 2, 0, decode="static", precision="int8", share=False)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=4))
    assert "sliding" in static_decode.static_decode_unsupported(mistral)
    with pytest.raises(ValueError, match="sliding"):
        TransformersEngine(mistral, 2, 0, decode="static")
    assert static_decode.static_decode_unsupported(model) is None
    with pytest.raises(UserError, match="rollout.decode=static does not run rollout.precision=fp8_e4m3"):
        check_engine(EngineSpec(decode="static", precision="fp8_e4m3"))
    with pytest.raises(UserError, match="vLLM runs its own"):
        check_engine(EngineSpec(name="vllm", decode="static_compiled"))
    with pytest.raises(UserError, match="rollout.noise=philox sets"):
        check_engine(EngineSpec(name="vllm", noise="philox"))
    with pytest.raises(ValueError, match="noise='mt'"):
        TransformersEngine(model, 2, 0, noise="mt")
    check_engine(EngineSpec(decode="static_compiled", precision="bfloat16"))
    for decode in ("dynamic", "static"):  # an empty prompt has no position to score its first new token from
        with pytest.raises(ValueError, match="prompt 1 has no token"):
            sample(model, decode, SamplingParams(max_new_tokens=3), prompts=[[1, 5], []], seeds=[1, 2])
    from trustbatch.policy.forward import pack

    with pytest.raises(ValueError, match="prompt 0 has no token"):
        pack([[], [5, 7]], [[3], [4]], pad_id=0)


def test_every_chunk_shape_gets_its_compiled_graph(model, monkeypatch):
    """Each (rows, cache bucket, sampled or greedy) is a graph of the one compiled step, shared by every engine of
    the process; past dynamo's default recompile_limit of 8, a new shape ran uncompiled (no CUDA graph) for the rest
    of the run. backend="eager" stands in for inductor: the same guards and recompiles, no code generation.
    Reference: dynamo's own counters, one new graph per new shape."""
    from torch._dynamo.utils import counters

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", dynamic=kw.get("dynamic")))
    # dynamo's own patch, restored on exit (monkeypatch's undo deleted the config entry: later compiles failed with
    # "recompile_limit does not exist")
    with torch._dynamo.config.patch(recompile_limit=8):
        torch._dynamo.reset()
        counters.clear()
        train, held_out = (TransformersEngine(model, 2, 0, decode="static_compiled") for _ in range(2))
        sp = SamplingParams(temperature=1.0, max_new_tokens=3)
        for rows in range(1, 11):  # ten shapes, two engines
            (train if rows % 2 else held_out).generate([[1, 5, 6]] * rows, 1, sp, seeds=list(range(rows)))
        assert counters["stats"]["unique_graphs"] == 10 and counters["frames"]["ok"] == counters["frames"]["total"]
    torch._dynamo.reset()
