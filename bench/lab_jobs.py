"""How the lab should use a 2-core machine: two one-thread runs at once, or one two-thread run at a time.

    python bench/lab_jobs.py [--rounds 15] [--warmup 3] [--repeats 2] [--long]

``trustbatch lab run`` runs ``--jobs 2`` runs side by side with one torch thread each. This times the lab's
own run (the ``reference`` experiment's on-policy config, seed 0: 64 prompts × 8 samples, one optimizer
step per round; ``--long``: on ``chain_sum_steps``, the 24–30-token task) as whole ``trustbatch train``
processes, evaluation and checkpoints off, in three arms, interleaved repeat by repeat:

- ``two_at_once``: two one-thread processes started together (the runner's default);
- ``one_two_threads``: one process with two threads (``--jobs 1`` with two threads);
- ``one_alone``: one one-thread process with the other core idle (what sharing the machine costs a run).

Per process it reads ``step_s`` of each round after ``--warmup`` (rollouts + optimizer step + weight sync)
from metrics.jsonl. Throughput is rounds per second of the whole machine: 2 / (s per round) for
``two_at_once``, 1 / (s per round) otherwise; the last column divides it by ``one_two_threads``'.
The cached base of seed 0 is used (built first if missing, outside the timings). The 1-minute load
average is printed beside each figure: run it on a quiet machine. Arms are interleaved by ``harness.interleave``;
one JSON line per arm goes to ``bench/results/lab_jobs.jsonl``.
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

ARMS = ("two_at_once", "one_two_threads", "one_alone")


def overrides(args, run_dir: Path, threads: int) -> list[str]:
    from trustbatch.lab import load_experiment

    exp = load_experiment("reference")
    ov = [o for o in exp.overrides("onpolicy", 0) if not o.startswith("threads=")]
    if args.long:
        ov.append("task.name=chain_sum_steps")
    return ov + [f"threads={threads}", f"train.steps={args.rounds + args.warmup}", "eval.every=100000",
                 "checkpoint_every=100000", f"run_dir={run_dir}"]


def start(args, run_dir: Path, threads: int) -> subprocess.Popen:
    # output to a file, not a pipe: two runs at once are waited for one after the other, and a full pipe
    # would stall the second
    with open(run_dir.with_suffix(".log"), "w") as log:
        return subprocess.Popen([sys.executable, "-m", "trustbatch", "train", *overrides(args, run_dir, threads)],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def seconds_per_round(p: subprocess.Popen, run_dir: Path, warmup: int) -> float:
    if p.wait() != 0:
        raise SystemExit(f"run {run_dir} failed:\n{run_dir.with_suffix('.log').read_text()[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["step_s"] for r in recs if r["step"] > warmup and "step_s" in r)


def arm(name: str, args, out: Path) -> tuple[float, float, float]:
    """(seconds per round of one process, rounds/s of the machine, load average at the start)."""
    load = os.getloadavg()[0]
    dirs = [out / f"{name}-{len(list(out.iterdir()))}-{i}" for i in range(2 if name == "two_at_once" else 1)]
    threads = 2 if name == "one_two_threads" else 1
    procs = [start(args, d, threads) for d in dirs]
    s = statistics.mean(seconds_per_round(p, d, args.warmup) for p, d in zip(procs, dirs))
    return s, len(dirs) / s, load


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--long", action="store_true", help="chain_sum_steps (24-30-token completions)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        # the base is built (or found in the cache) by a one-round run first, so no arm pays for it
        p = start(argparse.Namespace(**{**vars(args), "rounds": 1, "warmup": 0}), out / "warm", 2)
        seconds_per_round(p, out / "warm", -1)
        res: dict[str, list[tuple[float, float, float]]] = {a: [] for a in ARMS}

        def measured(name: str) -> float:
            res[name].append(arm(name, args, out))
            return res[name][-1][0]

        interleave({a: (lambda a=a: measured(a)) for a in ARMS}, args.repeats, warmup=0)
    ref = statistics.mean(t for _, t, _ in res["one_two_threads"])
    print(f"{'chain_sum_steps' if args.long else 'chain_sum'}, the lab's on-policy run, {args.rounds} rounds after "
          f"{args.warmup} warm-up, {args.repeats} repeats interleaved; means over repeats")
    print(f"{'arm':16s} {'s/round/process':>16s} {'rounds/s':>9s} {'vs one_two_threads':>19s}  load at start")
    for a in ARMS:
        s = statistics.mean(x for x, _, _ in res[a])
        t = statistics.mean(x for _, x, _ in res[a])
        print(f"{a:16s} {s:16.3f} {t:9.3f} {t / ref:18.2f}x  {', '.join(f'{x:.2f}' for _, _, x in res[a])}")
    record("lab_jobs", {a: {"s_per_round_per_process": [x for x, _, _ in res[a]], "rounds_per_s": [x for _, x, _ in res[a]],
                            "load_at_start": [x for _, _, x in res[a]],
                            "vs_one_two_threads": statistics.mean(x for _, x, _ in res[a]) / ref} for a in ARMS},
           extra={"task": "chain_sum_steps" if args.long else "chain_sum", "rounds": args.rounds,
                  "warmup_rounds": args.warmup}, save=not args.no_save)


if __name__ == "__main__":
    main()
