"""Processes that never outlive the process that started them: reward and rollout workers (children of the
trainer), the ranks of a torchrun job (children of its launcher) and a lab's runs (children of its forkserver,
started by the lab); and the process tree read from ``/proc``, for waiting until a local Ray cluster is gone.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

_PARENT_CHECK_S = 1.0  # how often a child checks that its parent is alive
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_watching_agent = False


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be killed when the parent dies, and watch for it where the kernel cannot help.

    On Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``; it fires when the
    *thread* that started the child exits, so start children from a long-lived thread). Everywhere,
    a daemon thread checks ``getppid()`` every second and exits when the parent is gone.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:  # also covers a child stuck in user code while the parent is gone
        while True:
            time.sleep(_PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="trustbatch-parent-watch").start()


def die_with_torchrun_agent() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set): this rank dies when the launcher, its parent, dies; else nothing.

    torchrun starts every rank in a session of its own, so a launcher killed with SIGKILL (no handler of its own
    runs) would leave the ranks training as orphans. Called as early as possible (``cli.main``) and again where the
    ranks meet (``parallel.World.from_env``, for scripts under torchrun); the second call does nothing. A rank whose
    parent is already ``init`` (pid 1) lost its launcher while it started, and exits at once (code 1).
    Where another process adopts orphans (a ``PR_SET_CHILD_SUBREAPER`` such as ``systemd --user``) that check
    cannot tell, and a rank orphaned before this call waits in ``init_process_group`` for the launcher's store.
    """
    global _watching_agent
    if _watching_agent or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if parent == 1:
        os._exit(1)
    _watching_agent = True
    die_with_parent(parent)


def die_with_sentinel(sentinel: int) -> None:
    """In a child process: exit at once (code 0) when ``sentinel`` reaches end of file.

    ``sentinel`` is the read end of a pipe whose write end only the starting process holds, so end of file means
    it died, SIGKILL included: ``multiprocessing.parent_process().sentinel``. This is for children whose parent in
    the process tree is not the process that started them (a multiprocessing forkserver's child), where the
    parent-death signal and ``getppid()`` watch the wrong process. The pipe must carry no data once read.
    """

    def watch() -> None:
        select.select([sentinel], [], [])
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="trustbatch-starter-watch").start()


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def process_tree(roots: list[int]) -> list[int]:
    """``roots`` and every descendant of them now, from ``/proc`` (Linux); ``roots`` alone where there is none."""
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return list(roots)
    children: dict[int, list[int]] = {}
    for pid in pids:
        info = _ppid_and_state(pid)
        if info is not None:
            children.setdefault(info[0], []).append(pid)
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and waiting to be reaped, does not); False where there is no ``/proc``."""
    info = _ppid_and_state(pid)
    return info is not None and info[1] not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` seconds for every process of ``pids`` to end; returns those still running."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if running(p)]
    return left


def kill(pids: list[int]) -> None:
    """Send SIGKILL to each process of ``pids``; one that has already ended is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
