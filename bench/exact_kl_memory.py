"""Peak memory of a P3O learner step with the exact KL against the same step with k3, at the same chunking.

    python bench/exact_kl_memory.py [--layers 2] [--rows 4] [--tokens 128] [--chunk 64] [--repeats 1] [--threads 1]

The model is a random Qwen2.5-0.5B-shaped decoder (hidden 896, 14 heads, 2 KV heads, intermediate 4,864,
V = 151,936, tied embeddings) with ``--layers`` layers instead of 24 (the decoder's memory is the same in both arms;
the LM head, the part the exact KL changes, is the full one). Float32 on the CPU. The behaviour policy is a perturbed
copy of it, present in both arms (it is the rollout engine's model in a real run; the k3 arm never reads it), sampled
at T = 0.7: the exact arm rebuilds its distribution by teacher forcing, chunk by chunk. One micro-batch of
``--rows`` rows × ``--tokens`` completion tokens (prompt 16), LM head in chunks of ``--chunk`` positions
(``train.logprob_chunk_size`` counts rows × columns: every row and ``--chunk // --rows`` columns).

Each arm runs in a fresh process: it builds everything, takes one learner step (warm-up: AdamW's state, the
allocator), then measures two more steps on the same batch, each as its peak RSS (VmHWM, reset through
``/proc/self/clear_refs``) minus the RSS before it: what one step adds to a run in progress. ``step_peak_mib`` is a
whole step; ``fwd_bwd_peak_mib`` the same step with AdamW's update left out (``optimizer.step`` a no-op): its
forward, LM-head chunks and backward, the part the exact KL changes (AdamW's own temporaries, about three copies
of the weights, otherwise set the whole step's peak). Arms are interleaved ``--repeats`` times
(``harness.interleave``); one JSON line per arm, and the ratios exact / k3 of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                  vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=1000000.0)
ARMS = {"k3": {"kl": "k3"}, "exact": {"kl": "exact"}}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def child(arm: str, a) -> dict:
    """One measurement of ``arm`` in this (fresh) process."""
    import copy

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trustbatch.pipeline.batch import TrainBatch
    from trustbatch.policy.forward import Teacher, pack
    from trustbatch.trainer.learner import Learner

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, num_hidden_layers=a.layers))
    behaviour = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.mul_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    V = QWEN25_05B["vocab_size"]
    prompts = [torch.randint(3, V, (16,), generator=g).tolist() for _ in range(a.rows)]
    comps = [torch.randint(3, V, (a.tokens,), generator=g).tolist() for _ in range(a.rows)]
    packed = pack(prompts, comps, pad_id=0)
    blp = torch.full((a.rows, a.tokens), -11.0)  # about log(1/V): the ratios are near 1, as on-policy data
    batch = TrainBatch(packed, blp, torch.randn(a.rows, generator=g), behaviour={0: Teacher(behaviour, 0.7)})
    learner = Learner(model, "p3o", ARMS[arm], micro_batch_size=a.rows, logprob_chunk_size=a.chunk,
                      shared_prompt=False)
    learner.step(batch)
    out = {}
    for name in ("step", "fwd_bwd"):
        if name == "fwd_bwd":
            learner.optimizer.step = lambda *args, **kw: None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _status_bytes("VmRSS")
        t0 = time.perf_counter()
        metrics = learner.step(batch)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_peak_mib"] = (_status_bytes("VmHWM") - base) / 2 ** 20
    return {**out, "kl_behavior": metrics.get("kl_behavior")}


def _spawn(arm: str, a) -> dict:
    cmd = [sys.executable, __file__, "--child", arm] + [f"--{k}={getattr(a, k)}" for k in
                                                       ("layers", "rows", "tokens", "chunk", "threads")]
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)}, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = options(argparse.ArgumentParser())
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=list(ARMS))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a)))
        return
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}

    interleave({arm: lambda arm=arm: runs[arm].append(_spawn(arm, a)) for arm in ARMS}, repeats=a.repeats, warmup=0)
    shape = {k: getattr(a, k) for k in ("layers", "rows", "tokens", "chunk", "threads")}
    chunk_mib = a.chunk * QWEN25_05B["vocab_size"] * 4 / 2 ** 20  # one [rows, chunk // rows, V] float32 buffer
    keys = ("step_peak_mib", "fwd_bwd_peak_mib", "step_s", "fwd_bwd_s")
    lines = record("exact_kl_memory", {arm: {**{k: [r[k] for r in rs] for k in keys},
                                             "kl_behavior": rs[-1]["kl_behavior"]} for arm, rs in runs.items()},
                   extra={**shape, "vocab": QWEN25_05B["vocab_size"], "hidden": QWEN25_05B["hidden_size"],
                          "chunk_buffer_mib": round(chunk_mib, 1)}, save=not a.no_save)
    med = {line["arm"]: line for line in lines}
    print(json.dumps({f"ratio_exact_over_k3_{k}": round(med["exact"][k]["median"] / med["k3"][k]["median"], 4)
                      for k in ("step_peak_mib", "fwd_bwd_peak_mib")}))


if __name__ == "__main__":
    main()
