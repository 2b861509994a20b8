"""Forward + backward time of every objective on B=64, T=2048, float32, CPU; ratios to grpo in the same run.

    python bench/objectives.py [--B 64] [--T 2048] [--repeats 7] [--threads 2]

Each objective is timed on the same inputs, interleaved round-robin over repeats (``harness.interleave``, after
one untimed warm-up) so that machine noise hits all of them alike; the median is reported. The batch-scope ESS
pass (RatioStats over the batch, what the trainer adds when it splits a batch) is timed on its own. One JSON line
per objective (seconds: median, min, max) is appended to ``bench/results/objectives.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from trustbatch import objectives
from trustbatch.objectives import RatioStats

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402


def main() -> None:
    ap = options(argparse.ArgumentParser())
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    B, T = a.B, a.T
    blp = -torch.rand(B, T, generator=g) * 3
    lp0 = blp + 0.3 * torch.randn(B, T, generator=g)
    prox = blp + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]

    def run(name: str) -> float:
        lp = lp0.clone().requires_grad_(True)
        kw = {"proximal_logprobs": prox} if objectives.spec(name).needs_proximal else {}
        t = time.perf_counter()
        out = objectives.get(name)(lp, blp, adv, mask, **kw)
        out.loss.backward()
        return time.perf_counter() - t

    def ess_pass() -> float:
        t = time.perf_counter()
        RatioStats.from_logprobs(lp0, blp, mask).ess()
        return time.perf_counter() - t

    arms = {n: (lambda n=n: run(n)) for n in objectives.names()}
    arms["batch ESS pass"] = ess_pass
    times = interleave(arms, a.repeats)
    base = statistics.median(times["grpo"])
    print(f"objectives forward+backward, B={B} T={T} float32, {a.threads} threads, median of {a.repeats}, "
          f"valid tokens {int(mask.sum())}")
    print(f"{'objective':<18}{'ms':>10}{'x grpo':>10}")
    for n, ts in times.items():
        med = statistics.median(ts)
        print(f"{n:<18}{med * 1e3:>10.2f}{med / base:>10.2f}")
    record("objectives", {n: {"s": ts, "x_grpo": statistics.median(ts) / base} for n, ts in times.items()},
           extra={"B": B, "T": T, "dtype": "float32", "threads": a.threads, "valid_tokens": int(mask.sum())},
           save=not a.no_save)


if __name__ == "__main__":
    main()
