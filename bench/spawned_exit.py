"""How often two spawned gloo ranks fail on their way out, ended through Python's finalisation against ended by
``processes.exit_without_finalizing``, side by side: the data-parallel step of ``tests/integration/test_parallel.py``
(``two_gloo_ranks(_ddp_steps)``, three objectives, one optimizer step each) again and again, the two ways taking
turns, with busy loops beside it as the rest of a test suite on a 2-core machine.

    python bench/spawned_exit.py [--runs 100] [--busy 1]

A failure is a rank that did not exit 0 (``torch.multiprocessing.ProcessExitedException``), counted by its signal.
CI at stop 53 lost that test's module fixture to one SIGABRT of rank 1 (pytorch/pytorch#190489). One JSON line to
``bench/results/spawned_exit.jsonl``: launches and failures for each way, seconds.

Measured (2-core AMD EPYC): no failure either way, 150 launches each with ``--busy 1`` (1,645 s) and 80 each with
``--busy 3`` (1,544 s). This bench did not reproduce CI's abort, so for spawned ranks the change rests on the
mechanism and on ``bench/torchrun_exit.py``'s counts (6 aborts in 205 torchrun launches before, 0 in 230 after),
not on a count of its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "tests" / "integration")]
from gloo_ranks import two_gloo_ranks  # noqa: E402
from test_parallel import _ddp_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100, help="launches of each way")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the ranks")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="spawned_exit-"))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    failures = {"finalize": {}, "exit_without_finalizing": {}}
    started = time.time()
    try:
        for i in range(args.runs):
            for finalize in (True, False):
                way = "finalize" if finalize else "exit_without_finalizing"
                out = work / f"{i}-{way}"
                out.mkdir()
                try:
                    two_gloo_ranks(_ddp_steps, out, finalize=finalize)
                    why = "ok"
                except mp.ProcessExitedException as e:
                    why = f"signal {e.signal_name}" if e.signal_name else f"exit {e.exit_code}"
                    failures[way][why] = failures[way].get(why, 0) + 1
                shutil.rmtree(out, ignore_errors=True)
                print(f"launch {i + 1}/{args.runs} {way}: {why}", flush=True)
    finally:
        for s in spinners:
            s.kill()
        shutil.rmtree(work, ignore_errors=True)
    row = {"bench": "spawned_exit", "busy": args.busy, "launches_each": args.runs, "failures": failures,
           "seconds": round(time.time() - started, 1)}
    print(json.dumps(row))
    with (ROOT / "bench" / "results" / "spawned_exit.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
