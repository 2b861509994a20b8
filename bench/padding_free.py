"""Padded against padding-free (packed) learner micro-batches: forward + backward time and tokens/s, side by side.

    python bench/padding_free.py [--threads 2] [--repeats 3] [--prompts 2] [--group 8] [--prompt 128]
                                 [--min-completion 32] [--completion 512] [--device cpu]

The ``bench/e2e.py --scale`` shape (random Llama, hidden 640, 8 layers, vocabulary 8192: ~48M parameters,
float32): ``--prompts`` prompts of ``--prompt`` tokens, ``--group`` completions each of lengths spread evenly
over [``--min-completion``, ``--completion``] (mixed lengths: the padded layout pads each to the longest), one
micro-batch. Each repeat is one forward + backward of Σ log-probs; arms interleaved (``harness``), rotating:

- ``padded``: the learner's default forward (``grouped_response_logprobs``, each distinct prompt once, trimmed);
- ``padded_plain``: ``response_logprobs`` (every row's prompt, left-padded);
- ``packed``: ``packed_response_logprobs`` (each distinct prompt once under the prefix-tree mask);
- ``packed_plain``: ``packed_response_logprobs(share_prompts=False)`` (every row's prompt, restarting positions).

tokens/s counts completion tokens (the log-probs the objective uses).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from trustbatch.policy.forward import pack, response_logprobs, trimmed
from trustbatch.policy.packed import packed_response_logprobs
from trustbatch.policy.shared_prompt import grouped_response_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from e2e import scale_model  # noqa: E402
from harness import interleave, options, record  # noqa: E402

ARMS = {
    "padded": trimmed(grouped_response_logprobs),
    "padded_plain": response_logprobs,
    "packed": packed_response_logprobs,
    "packed_plain": lambda m, p: packed_response_logprobs(m, p, share_prompts=False),
}


def rows(a) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    prompts, comps = [], []
    for _ in range(a.prompts):
        p = torch.randint(3, 8192, (a.prompt,), generator=g).tolist()
        for k in range(a.group):
            n = a.min_completion + (a.completion - a.min_completion) * k // max(a.group - 1, 1)
            prompts.append(p)
            comps.append(torch.randint(3, 8192, (n,), generator=g).tolist())
    return prompts, comps


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--min-completion", type=int, default=32)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = scale_model().to(a.device)
    prompts, comps = rows(a)
    packed = pack(prompts, comps, pad_id=0).to(a.device)
    tokens = float(packed.response_mask.sum())
    padded_positions = packed.input_ids.numel()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter Llama on {a.device}, {len(comps)} rows: "
          f"{a.prompts} prompts of {a.prompt} tokens, completions {a.min_completion}..{a.completion} tokens "
          f"({int(tokens)} completion tokens, {padded_positions} padded positions), {a.threads} threads", flush=True)

    def arm(name: str) -> None:
        model.zero_grad(set_to_none=True)
        logp, _ = ARMS[name](model, packed)
        (logp * packed.response_mask).sum().backward()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    times = interleave({k: (lambda k=k: arm(k)) for k in ARMS}, a.repeats, warmup=a.warmup, rotate=True)
    for name, ts in times.items():
        md = statistics.median(ts)
        print(f"{name:>13}: {md:.3f} s  ({min(ts):.3f}..{max(ts):.3f})  {tokens / md:,.0f} completion tokens/s  "
              f"{statistics.median(times['padded']) / md:.2f}× padded's speed")
    record("padding_free", {k: {"s": ts, "tokens_per_s": tokens / statistics.median(ts)} for k, ts in times.items()},
           extra={"model": "e2e --scale Llama (~48M)", "device": a.device, "threads": a.threads, "rows": len(comps),
                  "prompt": a.prompt, "completions": [a.min_completion, a.completion], "completion_tokens": tokens},
           save=not a.no_save)


if __name__ == "__main__":
    main()
