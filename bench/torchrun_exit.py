"""How often a finished 2-rank torchrun job fails on its way out: resume the tiny job's 2-rank run for its last rounds
again and again, with busy loops beside it, and count the launches that exit non-zero, by the signal that ended the
rank (SIGABRT: a gloo worker thread that asked for the GIL while Python finalised, pytorch/pytorch#190489;
SIGSEGV: anything else in native code).

    python bench/torchrun_exit.py [--runs 60] [--strategy fsdp2] [--lora] [--busy 1]

A run of ``--steps-before`` rounds is made once (its checkpoint is the start of every launch), then each launch
copies it and runs ``trustbatch train --resume COPY train.steps=STEPS`` under ``torchrun --nproc-per-node 2``:
what every launch does after its start is the same work as the resume test of ``tests/integration/test_fsdp2*.py``.
``--busy`` processes spin beside it, as the rest of a test suite does on a 2-core machine, so a rank's threads wait
for a core. One JSON line to ``bench/results/torchrun_exit.jsonl``: launches, failures by signal, seconds.

Measured (2-core AMD EPYC, ``--busy 1``), before ``processes.exit_without_finalizing``: 6 SIGABRT and 1 SIGSEGV in
205 launches (LoRA and full fine-tuning); after: 0 in 230 (180 with ``--lora``, 50 without; the last 60
by this script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from tiny import TINY  # noqa: E402

SIGNAL = re.compile(r"exitcode\s*:\s*(-\d+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--strategy", default="fsdp2", choices=("ddp", "fsdp2"))
    ap.add_argument("--lora", action="store_true", help="model.lora.r=4 (adapters sharded with their base)")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the job")
    ap.add_argument("--steps-before", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="torchrun_exit-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRUSTBATCH_CACHE": str(work / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "support")])}
    overrides = TINY + ["checkpoint_every=1", "threads=1", "train.lr=1e-2", "train.minibatches=2",
                        "reward.name=scorers_for_tests:even_length", "reward.workers=0",
                        f"train.strategy={args.strategy}"] + (["model.lora.r=4"] if args.lora else [])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "trustbatch", "train"]
    first = work / "start"
    subprocess.run([*torchrun, *overrides, f"train.steps={args.steps_before}", f"run_dir={first}"], cwd=ROOT,
                   env=env, check=True, capture_output=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    failures: dict[str, int] = {}
    started = time.time()
    try:
        for i in range(args.runs):
            run = work / "run"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(first, run)
            p = subprocess.run([*torchrun, "--resume", str(run), f"train.steps={args.steps}"], cwd=ROOT, env=env,
                               capture_output=True, text=True)
            if p.returncode != 0:
                codes = [int(c) for c in SIGNAL.findall(p.stderr) if int(c) != -15]  # -15: torchrun stopped the other
                why = f"signal {-codes[0]}" if codes else f"exit {p.returncode}"
                failures[why] = failures.get(why, 0) + 1
            print(f"launch {i + 1}/{args.runs}: {'ok' if p.returncode == 0 else why}", flush=True)
    finally:
        for s in spinners:
            s.kill()
        shutil.rmtree(work, ignore_errors=True)
    row = {"bench": "torchrun_exit", "strategy": args.strategy, "lora": args.lora, "busy": args.busy,
           "launches": args.runs, "failures": failures, "seconds": round(time.time() - started, 1)}
    print(json.dumps(row))
    out = ROOT / "bench" / "results" / "torchrun_exit.jsonl"
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
