"""The shared-prompt learner step with ``gather_rows`` against autograd's ``index_select``, side by side.

    python bench/gather_rows.py [--repeats 5] [--threads 1]

A random Llama of the lab's base size (hidden 128, 4 layers, 4 heads) with the project's tokenizer; 64
prompts × 8 completions, shuffled as the learner's minibatches are; ``short`` has 18-token prompts and
completions of 2–5 tokens (chain_sum), ``long`` 23-token prompts and 20–30 tokens (chain_sum_steps). One
step is the shared-prompt forward (log-probs and entropy) and the backward of Σ log-prob. Repeats are
interleaved after one untimed warm-up each (``harness.interleave``); medians are printed, and whether the
log-probs and every parameter's gradient are equal bit for bit; one JSON line per case and gather is appended
to ``bench/results/gather_rows.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from trustbatch.policy import shared_prompt as sp
from trustbatch.policy.forward import pack, trimmed
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402

CASES = {"short": (18, 2, 5), "long": (23, 20, 30)}  # prompt tokens, completion tokens (min, max)


def main() -> None:
    ap = options(argparse.ArgumentParser())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = train_tokenizer([f"Compute {x} + {y} = {x + y}" for x in range(40) for y in range(40)], vocab_size=384)
    model = build_small_llama(len(tok), hidden=128, layers=4, heads=4, max_len=128, seed=0, tokenizer=tok).train()
    fwd = trimmed(sp.grouped_response_logprobs)
    gathers = {"index_select": lambda x, i: x.index_select(0, i), "gather_rows": sp.gather_rows}
    print(f"threads={a.threads}, repeats={a.repeats} (median), 64 prompts x 8 completions, float32")
    print(f"{'case':<6} {'index_select s':>15} {'gather_rows s':>14} {'ratio':>7}  equal")
    results = {}
    for name, (plen, lo, hi) in CASES.items():
        g = torch.Generator().manual_seed(0)
        prompts = [[tok.bos_token_id] + torch.randint(3, len(tok), (plen - 1,), generator=g).tolist() for _ in range(64)]
        rows = [(p, torch.randint(3, len(tok), (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist())
                for p in prompts for _ in range(8)]
        rows = [rows[i] for i in torch.randperm(len(rows), generator=g)]
        packed = pack([p for p, _ in rows], [c for _, c in rows], tok.pad_token_id)

        def step():
            logp, _ = fwd(model, packed, with_entropy=True)
            (logp * packed.response_mask).sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return logp.detach(), grads

        out = {}

        def arm(k):
            sp.gather_rows = gathers[k]
            out[k] = step()

        try:
            times = interleave({k: (lambda k=k: arm(k)) for k in gathers}, a.repeats)
        finally:
            sp.gather_rows = gathers["gather_rows"]
        (la, ga), (lb, gb) = out["index_select"], out["gather_rows"]
        equal = torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb))
        i, o = statistics.median(times["index_select"]), statistics.median(times["gather_rows"])
        print(f"{name:<6} {i:>15.3f} {o:>14.3f} {i / o:>6.2f}x  {'bit for bit' if equal else 'NO'}")
        results.update({f"{name}/{k}": {"s": ts, "bit_for_bit": equal} for k, ts in times.items()})
    record("gather_rows", results, extra={"threads": a.threads, "prompts": 64, "samples": 8, "dtype": "float32"},
           save=not a.no_save)


if __name__ == "__main__":
    main()
