"""What starting a lab run costs: a fresh interpreter against a fork of ``lab.launch``'s warm server.

    python bench/lab_launch.py [--repeats 4]

Times the lab's on-policy run (the ``reference`` experiment's config, seed 0, its cached base) cut to one
round with evaluation, checkpoints and plots as in a real run but evaluated only at the end, from launch to
exit, two ways, interleaved repeat by repeat, one at a time on one thread:

- ``subprocess``: ``python -m trustbatch train`` (how the runner started runs before ``lab.launch``);
- ``forkserver``: ``lab.launch.Run`` (the runner's way now), after the server has started once.

The difference is what each of an experiment's runs no longer spends on imports. The server's own start
(once per ``trustbatch lab run`` call) is printed separately. Run it on a quiet machine.
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


def overrides(run_dir: Path) -> list[str]:
    from trustbatch.lab import load_experiment

    exp = load_experiment("reference")
    return exp.overrides("onpolicy", 0) + ["train.steps=1", "eval.every=1", f"run_dir={run_dir}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    from trustbatch.lab.launch import Run

    env = dict(os.environ, OMP_NUM_THREADS="1")
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the base of seed 0, built or loaded once outside the timings
        subprocess.run([sys.executable, "-m", "trustbatch", "train", *overrides(tmp / "warm")], check=True,
                       stdout=subprocess.DEVNULL, env=env)
        t = time.perf_counter()
        Run(["train", "--help"], tmp / "server.log").wait()
        server_s = time.perf_counter() - t
        times: dict[str, list[float]] = {"subprocess": [], "forkserver": []}
        for r in range(args.repeats):
            for how in times:
                run_dir = tmp / f"{how}{r}"
                t = time.perf_counter()
                if how == "subprocess":
                    with open(tmp / f"{how}{r}.log", "w") as log:
                        code = subprocess.run([sys.executable, "-m", "trustbatch", "train", *overrides(run_dir)],
                                              stdout=log, stderr=subprocess.STDOUT, env=env).returncode
                else:
                    code = Run(["train", *overrides(run_dir)], tmp / f"{how}{r}.log").wait()
                times[how].append(time.perf_counter() - t)
                if code != 0:
                    sys.exit(f"{how} run {r} failed (exit {code}): see {tmp / f'{how}{r}.log'}")
    print(f"server start (once per lab run call, `trustbatch train --help` included): {server_s:.1f} s")
    print(f"{'launch':<12} {'median s':>9} {'min s':>7} {'max s':>7}   (a one-round run, launch to exit, "
          f"{args.repeats} repeats; load {os.getloadavg()[0]:.1f})")
    for how, ts in times.items():
        print(f"{how:<12} {statistics.median(ts):>9.2f} {min(ts):>7.2f} {max(ts):>7.2f}")
    saved = statistics.median(times["subprocess"]) - statistics.median(times["forkserver"])
    print(f"saved per run: {saved:.2f} s (median difference)")


if __name__ == "__main__":
    main()
