"""On CUDA: the static-cache decode loop compiled with CUDA graphs against the dynamic loop, and the noise streams.

Prepared without a GPU (none was lent to the session that wrote it); the same checks run on the CPU in
tests/unit/test_static_decode.py.

* float32: ``static_compiled`` (``mode="reduce-overhead"``) samples the dynamic loop's tokens on the same seeds, its
  log-probs within ``TOL_F32`` = 5e-5: the CPU's measured gap (≤ 1.9e-6 on the same model, its own float32 error
  3–4.4e-6) with room for CUDA's attention kernels, which pick their reductions by key length; far below a wrong
  position or mask (≥ 1e-2 on the CPU). TF32 matmuls are off in torch by default.
* bf16 (the learner's autocast, as a bf16-mixed run samples): the two loops round differently in bf16, so a near tie
  can send a row down another path: no token equality is asserted. Instead each engine's batch against the
  bf16-mixed learner's float32 log-probs (the on-policy check of scale-up.md invariant 1): 1 − ESS of the static
  loop within 4× the dynamic loop's own (both are bf16 round-off of differently shaped forwards, O(1e-4) on the
  default job, tests/gpu/test_train_cuda.py) plus 1e-5. On the CPU (this test with cuda read as cpu): dynamic
  9.1e-5, static_compiled 5.5e-5 (2.6e-4 without ``emulate_precision_casts``, ``static_decode.compile_options``).
* philox: the same uniforms on CUDA as on the CPU, bit for bit (integer arithmetic); the generator stream's
  pinned, one-step-ahead, multi-threaded draws equal ``row_uniforms``.
"""

import copy

import pytest
import torch

from trustbatch.rollout import SamplingParams, TransformersEngine
from trustbatch.rollout.gumbel import GeneratorStream, philox_uniforms, row_uniforms

from peaked_llama import peaked_llama

TOL_F32 = 5e-5
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 3, 3, 3, 3, 3, 4], [1, 5, 6, 7, 8]]
SEEDS = [11, 12, 13, 14]


def _llama(vocab=40, hidden=32, layers=2):
    return peaked_llama(vocab, hidden, layers).cuda()


def _worst(a, b) -> float:
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.truncated for r in a] == [r.truncated for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.behavior_logprobs, rb.behavior_logprobs))


@pytest.mark.parametrize("noise", ["philox"])  # generator noise: compiled in the bf16 test (one compile each)
def test_compiled_static_samples_what_dynamic_samples_float32(noise):
    model = _llama()
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24)
    dynamic = TransformersEngine(model, 2, 0, noise=noise).generate(PROMPTS, 4, sp, seeds=SEEDS)
    fast = TransformersEngine(model, 2, 0, decode="static_compiled", noise=noise)
    for _ in range(3):  # warm-up, CUDA-graph capture, replay
        worst = _worst(dynamic, fast.generate(PROMPTS, 4, sp, seeds=SEEDS))
        print(f"\nstatic_compiled {noise} float32 on CUDA: max |Δ logprob| {worst:.1e}")
        assert worst <= TOL_F32


def _one_minus_ess(model, decode) -> float:
    from trustbatch.objectives import RatioStats
    from trustbatch.pipeline.batch import build_batch
    from trustbatch.trainer import Learner

    m = copy.deepcopy(model)
    learner = Learner(m, "grpo", precision="bf16-mixed")
    engine = TransformersEngine(m, 2, 0, autocast=torch.bfloat16, decode=decode)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (8,), generator=g)]
    engine.generate(prompts, 2, SamplingParams(max_new_tokens=32), seeds=list(range(8)))  # compile and capture
    rollouts = engine.generate(prompts, 8, SamplingParams(max_new_tokens=32), seeds=list(range(8)))
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), pad_id=0)
    logp = learner.logprobs(batch)
    return 1.0 - float(RatioStats.from_logprobs(logp, batch.behavior_logprobs.to(logp.device),
                                                batch.packed.response_mask.to(logp.device)).ess()[0])


def test_bf16_autocast_static_compiled_is_as_on_policy_as_dynamic():
    model = _llama(vocab=1000, hidden=128, layers=2)
    dynamic, static = _one_minus_ess(model, "dynamic"), _one_minus_ess(model, "static_compiled")
    print(f"\nbf16 autocast, 1 - ESS against the bf16-mixed learner: dynamic {dynamic:.1e}, static_compiled {static:.1e}")
    assert static <= 4 * dynamic + 1e-5, (static, dynamic)


def test_philox_is_the_same_on_cuda_and_cpu():
    keys = torch.tensor([5, 2**62 + 7, 123456789, 2**63 - 1])
    for step in (0, 1, 255):
        assert torch.equal(philox_uniforms(keys.cuda(), torch.tensor(step).cuda(), 151936).cpu(),
                           philox_uniforms(keys, step, 151936))


def test_generator_stream_ahead_on_cuda_draws_row_uniforms():
    seeds = list(range(40))
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    stream = GeneratorStream(seeds, 151936, "cuda", threads=4)
    assert stream.threads == 4
    for _ in range(5):
        assert torch.equal(stream.next().cpu(), row_uniforms(gens, 151936))
