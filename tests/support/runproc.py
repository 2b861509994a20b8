"""Real ``trustbatch train`` processes for the reliability tests: start, poll, kill, inspect via /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import TINY

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"tokens_per_s", "rollout_s", "step_s"}
# a short run that checkpoints every round, so a kill loses at most one round
SHORT = TINY + ["train.steps=6", "checkpoint_every=1", "threads=1"]


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """TRUSTBATCH_CACHE for every run of these tests, with the tiny base built once (runs in parallel then share it)."""
    from trustbatch.config import load_config
    from trustbatch.recipes import prepare_run

    path = tmp_path_factory.getbasetemp() / "trustbatch-cache"
    old = os.environ.get("TRUSTBATCH_CACHE")
    os.environ["TRUSTBATCH_CACHE"] = str(path)
    pool = prepare_run(load_config(None, TINY + ["reward.workers=0"]))[2]
    pool.close()
    yield path
    if old is None:
        del os.environ["TRUSTBATCH_CACHE"]
    else:
        os.environ["TRUSTBATCH_CACHE"] = old


def main_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``trustbatch ARGS`` through the command's own ``cli.main`` in this process: (exit code, stdout, stderr).

    For bad input refused before anything runs: the same code as ``python -m trustbatch`` without an interpreter
    start (3-7 s of CPU each, most of what such a test cost); each file keeps a few cases as real commands.
    """
    from trustbatch.cli import main

    monkeypatch.setattr(sys, "argv", ["trustbatch", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def train_args(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trustbatch", "train", *SHORT, f"run_dir={run}", *extra]


def resume_args(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trustbatch", "train", "--resume", str(run), *extra]


def start(args: list[str], log: Path) -> subprocess.Popen:
    """Start a command with stdout going to ``log`` and stderr to ``log``.err.

    Niced, so that the test's busy poll is scheduled first on a loaded machine and sees a checkpoint
    write that lasts milliseconds. SIGINT has its default disposition there, unblocked: a test suite started as a
    shell's background job inherits SIGINT ignored, and its children would then never see a Ctrl-C."""
    return subprocess.Popen(args, cwd=ROOT, stdout=open(log, "w"), stderr=open(f"{log}.err", "w"),
                            preexec_fn=_child_setup)


def _child_setup() -> None:
    os.nice(5)
    default_sigint()


def default_sigint() -> None:
    """In a child before exec: SIGINT's default disposition, unblocked, whatever this process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def signal_and_wait(proc: subprocess.Popen, sig: int, log: Path, timeout: float = 60) -> tuple[int, str]:
    """Send ``sig`` to ``proc`` (started by ``start`` with ``log``) and wait for it, killing it if it outlives
    ``timeout``; returns (exit code, its stderr)."""
    try:
        proc.send_signal(sig)
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, Path(f"{log}.err").read_text()


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def n_records(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def tmp_checkpoints(run_dir: Path) -> list[str]:
    try:
        return [n for n in os.listdir(run_dir / "checkpoints") if n.startswith(".tmp-")]
    except FileNotFoundError:
        return []


def wait_until(proc: subprocess.Popen, cond, what: str, timeout: float = 180) -> None:
    """Busy-poll ``cond()`` (a checkpoint write lasts milliseconds); fail if ``proc`` ends or time runs out first."""
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")


def kill_at_round(proc: subprocess.Popen, run_dir: Path, round_: int, timeout: float = 400) -> list[int]:
    """SIGKILL ``proc`` once ``run_dir``'s metrics.jsonl holds round ``round_`` (a sleeping poll: a round lasts far
    longer, and the run needs the cores); returns its descendants at that moment. Fails if the run ends or time runs
    out first (killed then too)."""
    try:
        deadline = time.time() + timeout
        while n_records(run_dir) < round_ + 1:
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before round {round_}"
            assert time.time() < deadline, f"timed out waiting for round {round_}"
            time.sleep(0.01)
        return descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def survivors(pids: list[int], within: float = 5.0) -> list[int]:
    t0 = time.time()
    while time.time() - t0 < within:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def outlived(pids: list[int], within: float = 30.0) -> list[int]:
    """``survivors`` after ``within`` s, each then killed with SIGKILL, so that a failing test leaves nothing training."""
    from trustbatch.processes import kill

    left = survivors(pids, within)
    kill(left)
    return left


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """JSONL records without the timing fields (they differ between any two runs)."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / name).read_text().splitlines()]


def weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    diff = {k: float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    assert not diff, f"weights differ from the uninterrupted run: {diff}"


def one_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr[-3000:]}"
    return lines[0]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file's bytes (the lock file aside: it only names its last owner)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}
