"""Building the lab's per-seed SFT bases: one at a time in the runner (two threads) against ``--jobs`` worker
processes of one thread each (``trustbatch.lab.runner.build_shared_base``), side by side.

Each arm builds the same seeds into a fresh cache (``TRUSTBATCH_CACHE``), so nothing is found cached; arms are
interleaved (serial, parallel, serial, ...) and the load average is printed beside each figure: these machines
are noisy. ``--sft-steps`` shortens the SFT (the lab's default is 600) so a repeat takes a minute or two. Arms are
interleaved by ``harness.interleave``; one JSON line per arm goes to ``bench/results/base_build.jsonl``.

    python bench/base_build.py --seeds 4 --sft-steps 150 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402

CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from trustbatch.lab import load_experiment
from trustbatch.lab.runner import build_shared_base
class Q:
    def print(self, *a, **k):
        pass
exp = load_experiment(sys.argv[2], [int(s) for s in sys.argv[3].split(",")])
exp.arms = {a: {**o, "model.sft_steps": int(sys.argv[4])} for a, o in exp.arms.items()}
build_shared_base(exp, Q(), jobs=int(sys.argv[5]))
"""


def one(arm: str, args) -> float:
    seeds = ",".join(str(s) for s in range(args.seeds))
    jobs, threads = (1, args.threads) if arm == "serial" else (args.jobs, 1)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRUSTBATCH_CACHE": cache, "OMP_NUM_THREADS": str(threads)}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CHILD, str(threads), args.experiment, seeds, str(args.sft_steps), str(jobs)],
                       env=env, check=True)
        return time.perf_counter() - t0


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--experiment", default="reference", help="a bundled lab experiment whose seeds' bases are built")
    ap.add_argument("--seeds", type=int, default=4, help="bases to build: seeds 0 … N−1")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes of the parallel arm")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the serial arm")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    loads: dict[str, list[float]] = {"serial": [], "parallel": []}

    def arm(name: str) -> float:
        loads[name].append(os.getloadavg()[0])
        s = one(name, args)
        print(f"repeat {len(loads[name]) - 1} {name:8s} {s:7.1f} s for {args.seeds} bases "
              f"(load before {loads[name][-1]:.2f})", flush=True)
        return s

    times = interleave({name: (lambda name=name: arm(name)) for name in loads}, args.repeats, warmup=0)
    ser, par = statistics.median(times["serial"]), statistics.median(times["parallel"])
    print(f"median: serial ({args.threads} threads) {ser:.1f} s, parallel ({args.jobs} × 1 thread) {par:.1f} s: "
          f"parallel / serial = {par / ser:.2f}×")
    record("base_build", {name: {"s": times[name], "load_before": loads[name]} for name in times},
           extra={"experiment": args.experiment, "seeds": args.seeds, "sft_steps": args.sft_steps, "jobs": args.jobs,
                  "threads": args.threads}, save=not args.no_save)


if __name__ == "__main__":
    main()
