"""Issue 48: a Ctrl-C (or SIGTERM) ends the run whatever the main thread is doing when it arrives.

Each case runs in a fresh interpreter (SIGINT's default disposition, nothing else of pytest's) and reproduces one way
CPython alone loses the signal; each script, run without ``interrupt_guard``, sleeps its full 30 s, so the time limit
fails the test on the plain interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from runproc import ROOT, default_sigint

LIMIT_S = 12.0  # RESEND_S is 2 s: a lost signal is re-delivered within it, a plain interpreter sleeps 30 s

HEAD = """
import os, signal, sys, threading, time
from trustbatch.interrupts import interrupt_guard
guard = interrupt_guard() if sys.argv[1] == "guard" else __import__("contextlib").nullcontext()
"""

# the kernel hands the SIGINT to another thread while the main thread sleeps: pthread_kill of that thread is such a
# delivery, made certain
OTHER_THREAD = HEAD + """
def other():
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    time.sleep(60)
with guard:
    threading.Thread(target=other, daemon=True).start()
    try:
        time.sleep(30)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""

# the KeyboardInterrupt is raised inside a finalizer, where CPython prints "Exception ignored" and drops it
IN_FINALIZER = HEAD + """
class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        t = time.time()
        while time.time() - t < 0.5:  # bytecode runs: the KeyboardInterrupt is raised here
            pass
with guard:
    try:
        Finalized()
        print("dropped", flush=True)
        time.sleep(30)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""

# a Ctrl-C's cleanup that outlasts the re-delivery period is not cut short by a re-delivery
SLOW_CLEANUP = HEAD + """
with guard:
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        finally:
            t = time.time()
            while time.time() - t < 5:  # longer than RESEND_S, in bytecode where a handler can run
                pass
            print("cleaned up", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def _run(script: str, mode: str = "guard", timeout: float = LIMIT_S) -> tuple[str, str, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=default_sigint)
    return done.stdout, done.stderr, time.monotonic() - t0


@pytest.mark.parametrize("script", [OTHER_THREAD, IN_FINALIZER], ids=["other_thread", "in_finalizer"])
def test_a_lost_ctrl_c_is_redelivered_to_the_main_thread(script):
    out, err, took = _run(script)
    assert out.endswith("interrupted\n"), (out, err)
    assert took < LIMIT_S


@pytest.mark.slow  # the control experiment, 12 s of sleeping past the limit (make test-slow)
def test_the_plain_interpreter_loses_those_ctrl_cs():
    """The cases above are real: without the guard, each sleeps on past the limit."""
    for script in (OTHER_THREAD, IN_FINALIZER):
        with pytest.raises(subprocess.TimeoutExpired):
            _run(script, "plain", timeout=6)


def test_a_redelivery_never_cuts_the_cleanup_of_the_first_ctrl_c_short():
    out, err, _ = _run(SLOW_CLEANUP)
    assert out == "cleaned up\ninterrupted\n", (out, err)
    assert "Traceback" not in err


def test_the_guard_restores_handlers_and_leaves_an_ignored_sigint_alone():
    script = HEAD + """
signal.signal(signal.SIGINT, signal.SIG_IGN)
before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1))
with guard:
    inside = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)
after = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1))
print(before == after, inside == (signal.SIG_IGN, True))
"""
    out, err, _ = _run(script)
    assert out == "True True\n", err


# a cleanup that ends just after the watcher's wait: its re-delivery then met SIGTERM's restored default action and
# killed the process without its message (the reviewer's sweep at RESEND_S = 2 s: 9 of 40 cleanups of 2.005-2.010 s).
# Here RESEND_S is 5 ms and 160 cleanups sweep around its multiples; the old order died within the first 40.
LATE_REDELIVERY = """
import os, signal, sys, time
import trustbatch.interrupts as interrupts
interrupts.RESEND_S = 0.005
ok = 0
for i in range(160):
    d = 0.0045 + 0.00003 * (i % 40) + 0.005 * (i // 40)
    try:
        with interrupts.interrupt_guard():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                t0 = time.monotonic()
                while time.monotonic() - t0 < d:  # a cleanup busy in Python, as a trainer's closing is
                    pass
    except KeyboardInterrupt:
        time.sleep(0.008)  # a re-delivery sent after the guard would land here
        ok += 1
print(ok, flush=True)
"""


def test_no_redelivery_outlives_the_guard():
    out, err, _ = _run(LATE_REDELIVERY, timeout=60)
    assert out == "160\n", (out, err)


FORK_EXIT = HEAD + """
with guard:
    pid = os.fork()
    if pid == 0:  # the child leaves the guarded block, as a raw fork's child may
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


def test_a_child_forked_in_the_guard_leaves_it_cleanly():
    """A child forked inside the block gets the parent's old handlers (no wakeup fd of the parent's) and, leaving the
    block itself, ends with its own status: the guard's bookkeeping, cleared in the child at the fork, raised there."""
    out, err, _ = _run(FORK_EXIT)
    assert out == "0 True\n", (out, err)
