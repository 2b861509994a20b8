"""``processes.Reaper`` (issue 46 item 3): what a process starts after its reaper dies with it, SIGKILL included, even
where the process's children do not (grandchildren whose parent outlives the driver, as a Ray raylet's agents do).
The Ray run itself: tests/integration/test_ray.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runproc import alive

SRC = Path(__file__).resolve().parents[2] / "src"

# The driver stand-in: a reaper (or none), then two shells that each keep a sleep going and outlive their parent
# (nothing makes them die with it); their process trees on stdout, one line each, then it waits
DRIVER = '''
import subprocess, sys, time
sys.path.insert(0, {src!r})
from trustbatch.processes import Reaper, process_tree

mode = sys.argv[1]
reaper = Reaper() if mode != "none" else None
shell = ["sh", "-c", "sleep 300 & sleep 300"]
first = subprocess.Popen(shell)
if mode == "guard":
    reaper.guard([first.pid])  # from now on, only that shell's tree
    time.sleep(0.5)  # the reaper has read it (a walk already under way may still see what starts meanwhile)
second = subprocess.Popen(shell)
for kid in (first, second):
    while len(process_tree([kid.pid])) < 3:
        time.sleep(0.01)
    print(" ".join(map(str, process_tree([kid.pid]))), flush=True)
if mode == "close":
    reaper.close()
    print("closed", flush=True)
time.sleep(600)
'''


def _run(tmp_path, mode: str):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(src=str(SRC)))
    # its own session, like a terminal's job: the test's process group is not the driver's
    p = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    trees = [[int(x) for x in p.stdout.readline().split()] for _ in range(2)]
    assert all(len(t) == 3 for t in trees), trees
    if mode == "close":
        assert p.stdout.readline().strip() == "closed"
    time.sleep(0.5)  # the reaper records what it guards every 0.2 s
    return p, trees


def _left_after(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(x) for x in pids):
        time.sleep(0.05)
    return [x for x in pids if alive(x)]


def _descendants_now(pid: int) -> list[int]:
    from trustbatch.processes import process_tree

    return [p for p in process_tree([pid]) if p != pid]


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the reaper reads /proc (Linux)")


@pytest.mark.parametrize("mode,killed,kept", [("reaper", [0, 1], []), ("none", [], [0, 1]), ("guard", [0], [1]),
                                              ("close", [], [0, 1])])
def test_a_reaper_kills_what_its_killed_driver_started_and_nothing_else(tmp_path, mode, killed, kept):
    # none: the control, in which the shells and their sleeps outlive the driver (the test can fail); guard: the
    # second shell started after guard() named the first; close: the reaper ended before the driver's death
    p, trees = _run(tmp_path, mode)
    reaper = [c for c in _descendants_now(p.pid) if c not in trees[0] + trees[1]]
    assert len(reaper) == (0 if mode in ("none", "close") else 1), reaper  # close() waited for it
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        gone_by = 5.0
        left = _left_after([x for i in killed for x in trees[i]] + reaper, gone_by)
        assert not left, f"{mode}: {left} outlived the driver by {gone_by} s"
        assert all(alive(x) for i in kept for x in trees[i]), f"{mode}: the reaper killed what it did not guard"
    finally:
        for x in trees[0] + trees[1]:
            if alive(x):
                os.kill(x, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
