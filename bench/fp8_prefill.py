"""Per-tensor FP8 rollouts: the plain path against prefill-once with reused scales, side by side.

    python bench/fp8_prefill.py [--repeats 5] [--threads 1]

The lab's shapes: a random Llama of the default base's size (hidden 128, 4 layers, 4 heads) with the
project's tokenizer, 64 prompts × 8 samples at temperature 1, under ``rollout.precision=fp8_e4m3``;
``short`` has 18-token prompts and 8 new tokens (chain_sum), ``long`` 23-token prompts and 40 new tokens
(chain_sum_steps). A random model rarely samples EOS, so completions run to the limit: the ``long``
case is the long task's worst length. Repeats are interleaved (plain, once, plain, …) after one untimed
warm-up each; medians are printed, and whether the two paths sampled the same tokens with the same
log-probs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trustbatch.policy import load_policy
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.rollout import SamplingParams, TransformersEngine

CASES = {"short": (18, 8), "long": (23, 40)}  # prompt tokens, new tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer([f"Compute {x} + {y} = {x + y}" for x in range(40) for y in range(40)], vocab_size=384)
        model = build_small_llama(len(tok), hidden=128, layers=4, heads=4, max_len=128, seed=0, tokenizer=tok)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        policy = load_policy(Path(tmp))
    print(f"threads={a.threads}, repeats={a.repeats} (median), fp8_e4m3, 64 prompts x 8 samples")
    print(f"{'case':<6} {'prompt':>6} {'new':>4} {'plain s':>8} {'once s':>7} {'plain/once':>11}  same samples")
    for name, (plen, new) in CASES.items():
        g = torch.Generator().manual_seed(0)
        prompts = [[tok.bos_token_id] + torch.randint(3, len(tok), (plen - 1,), generator=g).tolist() for _ in range(64)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=new)
        engines = {k: TransformersEngine(policy.model, policy.eos_id, policy.pad_id, precision="fp8_e4m3", prefill_once=k == "once")
                   for k in ("plain", "once")}
        times: dict[str, list[float]] = {k: [] for k in engines}
        out = {}
        for r in range(a.repeats + 1):
            for k, eng in engines.items():
                t = time.perf_counter()
                out[k] = eng.generate(prompts, 8, sp, seeds=list(range(64)))
                if r:  # the first round warms up
                    times[k].append(time.perf_counter() - t)
        same = all(x.completion_ids == y.completion_ids and x.behavior_logprobs == y.behavior_logprobs
                   for x, y in zip(out["plain"], out["once"]))
        p, o = statistics.median(times["plain"]), statistics.median(times["once"])
        print(f"{name:<6} {plen:>6} {new:>4} {p:>8.3f} {o:>7.3f} {p / o:>10.2f}x  {'bit for bit' if same else 'NO'}")


if __name__ == "__main__":
    main()
