"""Processes that never outlive the process that started them: reward and rollout workers (children of the
trainer), the ranks of a torchrun job (children of its launcher), a lab's runs (children of its forkserver,
started by the lab) and a local Ray cluster's processes (``Reaper``: grandchildren too, whose parent dies first);
and the process tree read from ``/proc``, for waiting until a local Ray cluster is gone.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import NoReturn

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


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (it sets ``TORCHELASTIC_RUN_ID`` in every rank)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


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
    if _watching_agent or not under_torchrun():
        return
    parent = os.getppid()
    if parent == 1:
        os._exit(1)
    _watching_agent = True
    die_with_parent(parent)


def exit_without_finalizing(code: object = 0) -> NoReturn:
    """End this process as ``sys.exit(code)`` would, but without Python's finalisation: the ``atexit`` handlers run,
    the standard streams are flushed, and ``os._exit`` ends the process.

    For a process that held a gloo process group: a rank of a torchrun job (``cli.main``), or a rank a script spawns
    itself (``torch.multiprocessing``; the tests' ``tests/support/gloo_ranks.py``), called after
    ``destroy_process_group``. torch.distributed's gloo backend frees the tensors of a finished collective on its own
    worker threads, which need the GIL when a tensor holds a Python object. Once the interpreter is finalising
    (after the ``atexit`` handlers), a thread that asks for the GIL is ended by ``pthread_exit``, which C++ turns
    into ``std::terminate``: SIGABRT ("terminate called without an active exception") in a rank that had written
    all its work, and torchrun (or ``torch.multiprocessing``'s join) reports the job as failed
    (pytorch/pytorch#190489; ``destroy_process_group`` does not stop those threads). Without the finalisation there
    is no such moment. What finalisation would do first runs here (non-daemon threads are joined, the
    ``atexit`` handlers run: temporary directories, loggers); what it does after that, freeing every object, the
    process does not need: its files are closed and its workers stopped by the command itself.

    ``code``: as ``SystemExit.code``: None is 0, an int is the exit status, anything else is printed to stderr and
    gives 1.
    """
    import atexit

    try:
        # what finalisation runs first, while every thread can still take the GIL: join the non-daemon threads
        # (and the thread pools' workers, through threading's own exit hooks), then the atexit handlers
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
                pass
        os._exit(code or 0)


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


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name: state, ppid, ..., start time (index 19)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return None


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    fields = _stat(pid)
    return None if fields is None else (int(fields[1]), fields[0])


def _born(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot): with the pid, it names one process even after pid reuse."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


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


_REAP_POLL_S = 0.2  # how often a reaper records the processes it guards and checks that its starter lives


class Reaper:
    """A watcher process that kills what this process starts from now on, should this process die first (SIGKILL
    included): a local Ray cluster, whose agents are children of the raylet and outlive a killed driver by minutes.

    The reaper runs ``python -m trustbatch.processes`` in a session of its own (a Ctrl-C or a hang-up of the
    terminal does not reach it) and, every ``_REAP_POLL_S``, records by pid and start time each process below this
    one that is new since it started, or, once ``guard`` names them, below those roots only. When this process is
    gone, or ``close(kill=True)`` is called, it stops the recorded processes that still run (SIGSTOP, so none forks
    any more), adds their children, and kills them all with SIGKILL; with ``close()`` it exits and kills nothing.
    Linux only (``/proc``); a process started and orphaned between two polls is not seen (a Ray worker exits on its
    own when its raylet dies).
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "trustbatch.processes", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        with self.proc.stdout:  # returns once the reaper knows what ran before it: all that starts later is guarded
            self.proc.stdout.read(1)

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the reaper is gone, or already closed
            pass

    def guard(self, roots: list[int]) -> None:
        """From now on guard ``roots`` and their descendants only."""
        self._send("guard " + " ".join(map(str, roots)))

    def close(self, kill: bool = False) -> None:
        """End the reaper: with ``kill``, once it has killed what it guards. Waits for it (at most 10 s)."""
        self._send("reap" if kill else "stop")
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _reap(starter: int) -> None:
    """The reaper process's loop (``Reaper``): guard the processes ``starter`` starts until it says stop."""
    me, born = os.getpid(), _born(starter)
    if born is None:  # gone before this reaper could look: it started nothing to guard
        return
    before = {(p, _born(p)) for p in process_tree([starter])}  # this reaper among them
    os.write(1, b"r")
    roots = {starter: born}  # pid -> start time: where the walk starts
    seen: dict[int, int] = {}
    buf = b""
    while _born(starter) == born:
        if select.select([0], [], [], _REAP_POLL_S)[0]:
            chunk = os.read(0, 4096)
            if not chunk:  # the starter closed its end without a word, or died
                break
            *lines, buf = (buf + chunk).split(b"\n")
            words = [line.split() for line in lines]
            if [b"stop"] in words:
                return
            if [b"reap"] in words:
                break
            for w in words:
                if w[:1] == [b"guard"]:
                    roots = {int(p): t for p in w[1:] if (t := _born(int(p))) is not None}
        for p in process_tree([p for p, t in roots.items() if _born(p) == t]):
            t = _born(p)
            if t is not None and p not in (me, starter) and (p, t) not in before:
                seen[p] = t
    _kill_recorded(seen, me)


def _kill_recorded(seen: dict[int, int], me: int) -> None:
    """SIGSTOP the recorded processes still running (pid and start time), then their children until no new one
    appears, then SIGKILL them all."""
    frozen: set[int] = set()
    todo = [p for p, t in seen.items() if _born(p) == t]
    while todo:
        _signal(todo, signal.SIGSTOP)
        frozen.update(todo)
        todo = [p for p in process_tree(sorted(frozen)) if p not in frozen and p != me]
    _signal(sorted(frozen), signal.SIGKILL)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # ended meanwhile, or not ours to signal: the others still get it
            pass


if __name__ == "__main__":
    _reap(int(sys.argv[1]))
