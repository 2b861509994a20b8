"""Rollout time with the growing key/value cache against transformers' own DynamicCache, side by side.

    python bench/kv_cache.py [--threads 1] [--repeats 5] [--tokens 40] [--precisions float32,fp8_e4m3]

The lab's shape: the default base's architecture (hidden 128, 4 layers, 4 heads; random weights, so
completions run to ``--tokens``), 64 prompts of 20 tokens × 8 samples, one thread as in a lab run.
For each rollout precision, the same engine generates the same seeded batch with
``policy.kv_cache.GrowingCache`` and with generate's default cache (the engine's ``grow_cache``
off), interleaved (default, growing, default, …) after one untimed warm-up each (``harness.interleave``), so
machine noise hits both; the median seconds per batch and their ratio are printed, and whether the two caches
gave identical tokens and log-probs; one JSON line per precision and cache goes to
``bench/results/kv_cache.jsonl``. float32 prefills each prompt once; fp8_e4m3 (per-tensor, batch-scaled) runs
the plain path, so both of the engine's paths are timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.rollout import SamplingParams, TransformersEngine

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402


def main() -> None:
    ap = options(argparse.ArgumentParser())
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--precisions", default="float32,fp8_e4m3")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = train_tokenizer([f"Compute {x} + {y} = {x + y}" for x in range(40) for y in range(40)], vocab_size=384)
    model = build_small_llama(len(tok), hidden=128, layers=4, heads=4, max_len=128, seed=0, tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_token_id] + torch.randint(3, len(tok), (19,), generator=g).tolist() for _ in range(64)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.tokens)
    print(f"threads={a.threads}, 64 prompts x 8 samples x up to {a.tokens} tokens, median of {a.repeats}, "
          f"load average at start {os.getloadavg()[0]:.2f}")
    print(f"{'precision':<10} {'default s':>10} {'growing s':>10} {'default/growing':>16} {'identical':>10}")
    results = {}
    for precision in a.precisions.split(","):
        eng = TransformersEngine(model, tok.eos_token_id, tok.pad_token_id or 0, precision=precision,
                                 share=precision == "float32")
        outs = {}

        def arm(grow):
            eng.grow_cache = grow
            outs[grow] = eng.generate(prompts, 8, sp, seeds=list(range(64)))

        arms = {"default": lambda: arm(False), "growing": lambda: arm(True)}
        times = interleave(arms, a.repeats)
        times = {False: times["default"], True: times["growing"]}
        same = all(x.completion_ids == y.completion_ids and x.behavior_logprobs == y.behavior_logprobs
                   for x, y in zip(outs[False], outs[True]))
        d, gr = statistics.median(times[False]), statistics.median(times[True])
        print(f"{precision:<10} {d:>10.2f} {gr:>10.2f} {d / gr:>15.2f}x {str(same):>10}")
        results.update({f"{precision}/{k}": {"s": times[k == "growing"], "identical": same} for k in arms})
    record("kv_cache", results, extra={"threads": a.threads, "prompts": 64, "samples": 8, "max_new_tokens": a.tokens},
           save=not a.no_save)


if __name__ == "__main__":
    main()
