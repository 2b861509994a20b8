"""No [B, C, V] tensor is built for the exact KL: the learner's exact-KL step runs under a memory limit that one such
tensor would exceed.

A fresh interpreter builds a tiny Llama with V = 100,000 and a batch of 2 rows × 128 completion tokens, so one
float32 [B, C, V] tensor is 102 MB, then caps its own data segment (``RLIMIT_DATA``, which covers malloc's mmaps
since Linux 4.7) at what it uses plus 70 MB and takes a P3O and a two-anchor P3O step with kl="exact" at
``logprob_chunk_size=8`` (6.4 MB per [B, k, V] buffer). malloc returns every block of 256 KiB or more to the system
(``MALLOC_MMAP_THRESHOLD_``: below one decoding step's [2, V] scores, 800 KB, which the heap would otherwise keep
fragmented), so the limit counts what is alive. The control is the same step on the full LM-head path
(``logprob_chunk_size=None``: [B, C + 1, V] logits), which must hit the limit: the limit bites. The same holds for
the transformers engine generating those 128 tokens for 2 rows: it keeps no [N, steps, V] stack of scores.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

V, B, C = 100_000, 2, 128
LIMIT_MB = 70

CHILD = textwrap.dedent(f"""
    import copy, json, resource, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trustbatch.pipeline.batch import TrainBatch
    from trustbatch.policy.forward import Teacher, pack
    from trustbatch.trainer.learner import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size={V}, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        behaviour.lm_head.weight.mul_(30.0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, {V}, (4,), generator=g).tolist() for _ in range({B})]
    comps = [torch.randint(3, {V}, ({C},), generator=g).tolist() for _ in range({B})]
    packed = pack(prompts, comps, pad_id=0)
    learners = {{name: Learner(copy.deepcopy(model), name, {{"kl": "exact"}}, micro_batch_size={B},
                              logprob_chunk_size=None if sys.argv[1] == "full" else 8)
                for name in ("p3o", "p3o_two_anchor")}}
    blp = torch.full(({B}, {C}), -12.0)
    batch = TrainBatch(packed, blp, torch.randn({B}, generator=g), behaviour={{0: Teacher(behaviour, 0.8)}})
    with open("/proc/self/status") as f:
        used = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmData:"))
    limit = used + {LIMIT_MB} * 2 ** 20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    out = {{}}
    try:
        if sys.argv[1] == "engine":
            from trustbatch.rollout import SamplingParams, TransformersEngine
            eng = TransformersEngine(model, eos_id=1, pad_id=0)
            ro = eng.generate(prompts[:1], {B}, SamplingParams(max_new_tokens={C}), seeds=[0])
            out["tokens"] = sum(len(r.behavior_logprobs) for r in ro)
        for name, learner in ({{}} if sys.argv[1] == "engine" else learners).items():
            out[name] = learner.train_on(batch)["kl_behavior"]
    except (MemoryError, RuntimeError) as e:
        out["error"] = str(e).splitlines()[0]
    print(json.dumps(out))
""")


def _run(arm: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2 ** 18), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", CHILD, arm], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_exact_kl_steps_fit_where_one_b_c_v_tensor_does_not():
    assert B * C * V * 4 / 2 ** 20 > LIMIT_MB  # one float32 [B, C, V] tensor is over the limit
    chunked = _run("chunked")
    assert "error" not in chunked, chunked
    assert chunked["p3o"] > 0.1 and chunked["p3o_two_anchor"] > 0  # the KL was computed, and is not negligible
    full = _run("full")
    assert "error" in full and "alloc" in full["error"].lower(), full


def test_the_engine_keeps_no_step_by_vocabulary_stack():
    got = _run("engine")
    assert got == {"tokens": B * C}, got  # no EOS in a random model's 128 tokens: each row ran every step
