"""Reward worker processes die with the process that made them (kill -9, SIGTERM, with and without
Linux's parent-death signal), ignore Ctrl-C, and keep what scorers print off the terminal."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

SCORERS = '''
import os, sys, time

def hang_or_match(completion, reference):
    if completion == "hang":
        time.sleep(3600)
    return 1.0 if completion == reference else 0.0

def noisy(completion, reference):
    for i in range(5000):
        print(f"stdout line {i} of a chatty scorer")
    print("NOISY-STDERR-END", file=sys.stderr)
    os.write(1, b"NOISY-FD1-END\\n")  # below Python's streams, as C code would write
    if completion == "fail":
        raise RuntimeError("noisy scorer gave up")
    if completion == "die":
        sys.stdout.flush()
        os._exit(7)
    return 1.0
'''

# The trainer stand-in: a pool of 2 workers that have scored, their pids on stdout, then it waits
# (idle, or with both workers inside a hanging scorer).
PARENT = '''
import signal, sys, time
# a terminal's process: Ctrl-C raises KeyboardInterrupt, whatever the test runner's own SIGINT state was
# (an ignored or blocked SIGINT is inherited across exec, and Python keeps an inherited SIG_IGN)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
sys.path[:0] = [{src!r}, {here!r}]
if {no_pdeathsig}:
    sys.platform = "fallback-test"  # the workers skip prctl and rely on the pipe and getppid
from trustbatch.rewards import RewardPool
pool = RewardPool("scorers_here:hang_or_match", workers=2, timeout_s=600)
assert pool.score(["a", "b", "c"], ["a", "b", "x"]).rewards == [1.0, 1.0, 0.0]
print(" ".join(str(w.proc.pid) for w in pool._pool), flush=True)
if {hang}:
    pool.score(["hang", "hang"], ["", ""])
try:
    time.sleep(600)
except KeyboardInterrupt:
    print("parent interrupted", flush=True)
    print(pool.score(["a", "b"], ["a", "a"]).rewards, flush=True)  # the workers survived Ctrl-C
'''


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie holds no memory; its reaper may be slow)."""
    try:
        import psutil
    except ImportError:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state not in ("Z", "X")
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def _start_parent(tmp_path, *, hang=False, no_pdeathsig=False):
    (tmp_path / "scorers_here.py").write_text(SCORERS)
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(src=str(SRC), here=str(tmp_path), hang=hang, no_pdeathsig=no_pdeathsig))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    line = p.stdout.readline()
    assert line.strip(), p.stderr.read()
    pids = [int(x) for x in line.split()]
    assert len(pids) == 2 and all(_alive(x) for x in pids)
    return p, pids


def _wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(x) for x in pids):
        time.sleep(0.05)
    return [x for x in pids if _alive(x)]


pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="process-tree checks need a POSIX system")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("hang", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("no_pdeathsig", [False, True], ids=["pdeathsig", "fallback"])
def test_workers_die_with_their_parent(tmp_path, sig, hang, no_pdeathsig):
    if not no_pdeathsig and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux only")
    p, pids = _start_parent(tmp_path, hang=hang, no_pdeathsig=no_pdeathsig)
    try:
        time.sleep(0.3)  # let busy workers enter the hanging scorer
        os.kill(p.pid, sig)
        p.wait(10)
        # the fallback polls getppid once a second; the kernel's signal is immediate
        survivors = _wait_gone(pids, 5.0)
        assert not survivors, f"workers {survivors} outlived their parent"
    finally:
        for x in pids:
            if _alive(x):
                os.kill(x, signal.SIGKILL)
        if p.poll() is None:
            p.kill()


def test_ctrl_c_leaves_workers_alive_and_quiet(tmp_path):
    p, pids = _start_parent(tmp_path)
    try:
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
        out, err = p.communicate(timeout=60)  # a loaded 2-core machine can take tens of seconds
    finally:
        if p.poll() is None:
            p.kill()
    assert "parent interrupted" in out
    assert "[1.0, 0.0]" in out  # the same workers scored after Ctrl-C
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not _wait_gone(pids, 5.0)  # and they ended with the parent's normal exit


def test_scorer_output_is_captured_and_its_tail_reported(tmp_path, monkeypatch, capfd):
    from trustbatch.rewards import RewardPool

    (tmp_path / "scorers_here.py").write_text(SCORERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardPool("scorers_here:noisy", workers=2, timeout_s=30) as pool:
        ok = pool.score(["x", "y"], ["", ""])
        assert ok.rewards == [1.0, 1.0] and ok.errors == 0 and ok.last_error is None
        bad = pool.score(["fail"], [""])
        assert bad.rewards == [0.0] and bad.errors == 1
        assert "RuntimeError: noisy scorer gave up" in bad.last_error
        assert "NOISY-FD1-END" in bad.last_error and "\n" not in bad.last_error
        dead = pool.score(["die", "x"], ["", ""])
        assert dead.rewards == [0.0, 1.0] and dead.errors == 1
        assert "exit code 7" in dead.last_error and "NOISY-FD1-END" in dead.last_error
    out, err = capfd.readouterr()
    assert "chatty scorer" not in out + err and "NOISY" not in out + err
    # bounded: the message carries a tail, not the 5000 lines
    assert len(bad.last_error) < 1000


def test_pool_survives_a_scorer_that_exits_and_counts_clamped(tmp_path, monkeypatch):
    from trustbatch.rewards import RewardPool

    (tmp_path / "odd_scorers.py").write_text(textwrap.dedent('''
        import sys
        def score(completion, reference):
            if completion == "exit":
                sys.exit(0)
            return {"hi": 2.5, "lo": -1.0, "str": "0.5"}.get(completion, 1.0)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    items = ["exit", "hi", "lo", "ok", "str"]
    for workers in (0, 2):
        with RewardPool("odd_scorers:score", workers=workers) as pool:
            res = pool.score(items, [""] * len(items))
        # a string is no score (issue 39): "0.5" is an error, not 0.5
        assert res.rewards == [0.0, 1.0, 0.0, 1.0, 0.0], workers
        assert (res.errors, res.timeouts, res.clamped) == (2, 0, 2), workers
        assert "returned str '0.5'" in res.last_error


def test_a_worker_killed_while_idle_is_replaced_on_the_next_call():
    import os
    import signal
    import time

    from trustbatch.rewards import RewardPool

    pool = RewardPool("scorers_for_tests:misbehave", workers=2, timeout_s=5)
    try:
        assert pool.score(["a", "b"], ["a", "x"]).rewards == [1.0, 0.0]
        os.kill(pool._pool[0].proc.pid, signal.SIGKILL)  # idle: no job in flight
        time.sleep(0.3)
        res = pool.score(["a", "b", "c"], ["a", "b", "x"])
        assert res.rewards == [1.0, 1.0, 0.0] and res.errors == 0
    finally:
        pool.close()


SELF_TERM = '''
import os, signal, sys, time
sys.path[:0] = [{src!r}, {here!r}]
from trustbatch.interrupts import interrupt_guard
from trustbatch.rewards import RewardPool
with interrupt_guard():  # what every command runs under (cli.main)
    with RewardPool("self_term:score", workers=1, timeout_s=30) as pool:
        r = pool.score(["ok", "die", "ok"], ["", "", ""])
        print(r.rewards, r.errors, flush=True)
        time.sleep(2.5)  # past the guard's re-delivery period
        print("still running", flush=True)
'''


def test_a_sigterm_to_a_worker_is_not_the_parents(tmp_path):
    """Workers forked under ``interrupt_guard`` inherited its wakeup fd, the parent's socket: a SIGTERM to a worker
    alone (a scorer killing its own process) read as the parent's, whose watcher re-delivered it 2 s later and ended
    the command. Now a forked child gets the parent's old handlers and no wakeup fd; the worker's death scores 0 and
    is counted (by hand: the rewards 1, 0, 1 and one error)."""
    (tmp_path / "self_term.py").write_text(
        "import os, signal\n"
        "def score(completion, reference):\n"
        "    if completion == 'die':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return 1.0\n")
    done = subprocess.run([sys.executable, "-c", SELF_TERM.format(src=str(SRC), here=str(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["[1.0, 0.0, 1.0] 1", "still running"], (done.stdout, done.stderr[-2000:])
