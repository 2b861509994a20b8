"""What starting a lab run costs: a fresh interpreter against a fork of ``lab.launch``'s warm server.

    python bench/lab_launch.py [--repeats 4] [--rounds 20]

Times the lab's on-policy run (the ``reference`` experiment's config, seed 0, its cached base) cut to one
round with evaluation, checkpoints and plots as in a real run but evaluated only at the end, from launch to
exit, two ways, interleaved repeat by repeat, one at a time on one thread:

- ``subprocess``: ``python -m trustbatch train`` (how the runner started runs before ``lab.launch``);
- ``forkserver``: ``lab.launch.Run`` (the runner's way now), after the server has started once.

The difference is what each of an experiment's runs no longer spends on imports. The server's own start
(once per ``trustbatch lab run`` call) is printed separately.

Then whether a forked run is as fast per round: one run of each kind at the same time (as the runner's two jobs
share the machine), ``--rounds`` rounds with evaluation off, compared by the median ``step_s`` of their rounds
after the first 3, the forked one started once the other has done its imports. Side by side, so a slower or
busier machine slows both alike. Run it on a quiet machine. Launches are interleaved by ``harness.interleave``; one
JSON line per launch kind goes to ``bench/results/lab_launch.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402


def overrides(run_dir: Path, rounds: int = 1) -> list[str]:
    from trustbatch.lab import load_experiment

    exp = load_experiment("reference")
    every = 1 if rounds == 1 else 10_000  # one round: evaluated at its end, as a run is; longer: evaluation off
    return exp.overrides("onpolicy", 0) + [f"train.steps={rounds}", f"eval.every={every}",
                                           f"checkpoint_every={max(rounds, 1)}", f"run_dir={run_dir}"]


def fresh(argv: list[str], log) -> subprocess.Popen:
    """``python -m trustbatch *argv`` in a new interpreter (the runner's way before ``lab.launch``)."""
    return subprocess.Popen([sys.executable, "-m", "trustbatch", *argv], stdout=log, stderr=subprocess.STDOUT)


def round_seconds(run_dir: Path, skip: int = 3) -> float:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["step_s"] for r in rows if "step_s" in r][skip:])


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the side-by-side per-round comparison (0: skip)")
    args = ap.parse_args()
    from trustbatch.lab.launch import Run

    os.environ["OMP_NUM_THREADS"] = "1"  # for the fresh interpreters and the server alike
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the base of seed 0, built or loaded once outside the timings
        if fresh(["train", *overrides(tmp / "warm")], subprocess.DEVNULL).wait() != 0:
            sys.exit("building or loading the base of seed 0 failed")
        t = time.perf_counter()
        Run(["train", "--help"], tmp / "server.log").wait()
        server_s = time.perf_counter() - t
        launched = {"subprocess": 0, "forkserver": 0}

        def launch(how: str) -> float:
            r = launched[how]
            launched[how] += 1
            run_dir = tmp / f"{how}{r}"
            t = time.perf_counter()
            if how == "subprocess":
                with open(tmp / f"{how}{r}.log", "w") as log:
                    code = fresh(["train", *overrides(run_dir)], log).wait()
            else:
                code = Run(["train", *overrides(run_dir)], tmp / f"{how}{r}.log").wait()
            s = time.perf_counter() - t
            if code != 0:
                sys.exit(f"{how} run {r} failed (exit {code}): see {tmp / f'{how}{r}.log'}")
            return s

        times = interleave({how: (lambda how=how: launch(how)) for how in launched}, args.repeats, warmup=0)
        per_round = {}
        if args.rounds:
            with open(tmp / "side_sub.log", "w") as log:
                sub = fresh(["train", *overrides(tmp / "side_sub", args.rounds)], log)
                while "run directory:" not in (tmp / "side_sub.log").read_text():  # its imports done: start together
                    if sub.poll() is not None:
                        sys.exit("the side-by-side subprocess run failed")
                    time.sleep(0.1)
                fork = Run(["train", *overrides(tmp / "side_fork", args.rounds)], tmp / "side_fork.log")
                if sub.wait() != 0 or fork.wait() != 0:
                    sys.exit("a side-by-side run failed")
            per_round = {"subprocess": round_seconds(tmp / "side_sub"), "forkserver": round_seconds(tmp / "side_fork")}
    print(f"server start (once per lab run call, `trustbatch train --help` included): {server_s:.1f} s")
    print(f"{'launch':<12} {'median s':>9} {'min s':>7} {'max s':>7}   (a one-round run, launch to exit, "
          f"{args.repeats} repeats; load {os.getloadavg()[0]:.1f})")
    for how, ts in times.items():
        print(f"{how:<12} {statistics.median(ts):>9.2f} {min(ts):>7.2f} {max(ts):>7.2f}")
    saved = statistics.median(times["subprocess"]) - statistics.median(times["forkserver"])
    print(f"saved per run: {saved:.2f} s (median difference)")
    if per_round:
        print(f"side by side, {args.rounds} rounds each, median step_s after round 3: subprocess "
              f"{per_round['subprocess']:.3f} s, forkserver {per_round['forkserver']:.3f} s "
              f"(forkserver / subprocess {per_round['forkserver'] / per_round['subprocess']:.3f})")
    record("lab_launch", {how: {"launch_to_exit_s": ts, "side_by_side_step_s": per_round.get(how)}
                          for how, ts in times.items()},
           extra={"server_start_s": server_s, "side_by_side_rounds": args.rounds}, save=not args.no_save)


if __name__ == "__main__":
    main()
