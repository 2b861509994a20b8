"""Asynchronous vs synchronous RL on this machine: wall time per round and completion tokens/s, side by side.

Runs ``trustbatch train`` as whole processes on the default task and base, interleaved
(sync, async, sync, async, ...), and reads each run's metrics.jsonl. Per round it takes ``step_s``
(next batch + optimizer steps + weight push; evaluation and checkpoints are switched off) and the
completion tokens, skipping the first ``--warmup`` rounds (process start, first batch). Prints the load
average next to each figure: these machines are noisy. Arms are interleaved by ``harness.interleave``; one JSON
line per arm (s/round, tokens/s, rollout and learner-wait seconds, staleness, load: one value per repeat) is
appended to ``bench/results/async_vs_sync.jsonl``.

    python bench/async_vs_sync.py --rounds 20 --repeats 2
    python bench/async_vs_sync.py --arms async,latest --k 2 --workers 2   # the price of the deterministic order

Arms (``--arms``, default ``sync,async``): ``sync`` (one process, --threads torch threads), ``async`` (learner
1 thread + --workers rollout workers of 1 thread, max_staleness --k, ``rollout.async_order=deterministic``, the
default) and ``latest`` (the same with ``rollout.async_order=latest``). On 2 cores sync against async with one
worker is the fair comparison: each arm uses both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402


def run(arm: str, args, out: Path) -> dict:
    run_dir = out / f"{arm}-{len(list(out.iterdir()))}"
    common = [f"train.steps={args.rounds + args.warmup}", "eval.every=100000", "checkpoint_every=100000",
              f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.prompts_per_step={args.prompts}",
              f"run_dir={run_dir}", *args.extra]
    if arm == "sync":
        extra = [f"threads={args.threads}"]
    else:
        extra = ["threads=1", "rollout.mode=async", f"rollout.max_staleness={args.k}", f"rollout.workers={args.workers}",
                 f"rollout.async_order={'latest' if arm == 'latest' else 'deterministic'}"]
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *common, *extra], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads if arm == "sync" else 1)})
    if p.returncode != 0:
        raise SystemExit(f"{arm} run failed:\n{p.stderr[-2000:]}")
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in recs if r["step"] > args.warmup and "step_s" in r]
    wall = sum(r["step_s"] for r in rounds)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rounds)
    return {"arm": arm, "s_per_round": wall / len(rounds), "tokens_per_s": tokens / wall,
            "rollout_s": statistics.mean(r["rollout_s"] for r in rounds),
            "wait_s": statistics.mean(r.get("learner_wait_s", 0.0) for r in rounds),
            "staleness": statistics.mean(r["staleness"] for r in rounds), "load": load}


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the sync process")
    ap.add_argument("--k", type=int, default=1, help="max_staleness of the async arms")
    ap.add_argument("--workers", type=int, default=1, help="rollout.workers of the async arms")
    ap.add_argument("--arms", default="sync,async", help="comma-separated, of sync, async (deterministic order), latest")
    ap.add_argument("--prompts", type=int, default=64, help="rollout.prompts_per_step")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("extra", nargs="*", help="more key=value overrides for both arms")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not arms or set(arms) - {"sync", "async", "latest"}:
        raise SystemExit(f"--arms takes sync, async, latest; got {args.arms!r}")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        results = []

        def arm(name: str) -> float:
            r = run(name, args, out)
            results.append(r)
            rep = sum(x["arm"] == name for x in results) - 1
            print(f"  {name:5s} rep {rep}: {r['s_per_round']:.3f} s/round  {r['tokens_per_s']:.0f} tok/s  "
                  f"rollout {r['rollout_s']:.3f} s  learner wait {r['wait_s']:.3f} s  "
                  f"staleness {r['staleness']:.2f}  (load {r['load']:.2f})", flush=True)
            return r["s_per_round"]

        interleave({name: (lambda name=name: arm(name)) for name in arms}, args.repeats, warmup=0)
    med = {arm: statistics.median(r["s_per_round"] for r in results if r["arm"] == arm) for arm in arms}
    tok = {arm: statistics.median(r["tokens_per_s"] for r in results if r["arm"] == arm) for arm in arms}
    print("median s/round: " + ", ".join(f"{a} {med[a]:.3f} ({tok[a]:.0f} tokens/s)" for a in arms)
          + "; throughput against " + arms[0] + ": " + ", ".join(f"{a} {med[arms[0]] / med[a]:.2f}x" for a in arms[1:]))
    fields = ("s_per_round", "tokens_per_s", "rollout_s", "wait_s", "staleness", "load")
    record("async_vs_sync", {arm: {k: [r[k] for r in results if r["arm"] == arm] for k in fields} for arm in arms},
           extra={"rounds": args.rounds, "warmup_rounds": args.warmup, "threads": args.threads, "k": args.k,
                  "workers": args.workers, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                  "overrides": args.extra},
           save=not args.no_save)


if __name__ == "__main__":
    main()
