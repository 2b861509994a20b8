"""Scoring in worker processes with a per-completion time limit, so that no scorer can stall or crash a run.

A scorer that raises, returns a non-finite value, kills its process or runs past ``timeout_s``
gives reward 0; the pool counts each case, replaces a dead or hung worker, and goes on.

A scorer scores units (``scorers.groups``): one completion each, or for TRL's batch form (``scorers.BatchForm``)
the whole group of one prompt's completions in one call, so that it may compare them. Units travel in chunks (one
message each way per about ``chunk_size`` completions, not per unit). The time limit stays per completion: a unit
of k completions gets k · ``timeout_s``. A worker writes the position and start time of the unit it is scoring into
a shared array, and the parent times that unit out. When a worker dies or hangs, that unit alone fails (each of its
completions counted) and the rest of its chunk is scored again by a fresh worker (the finished part's results died
with the process). Workers build the scorer from its name (``scorers.get``), so user functions need only be
importable.

Workers die with the process that made them, however it ends (kill -9 included): on Linux the
kernel sends them SIGKILL (``PR_SET_PDEATHSIG``); elsewhere, and as a fallback, each worker sees
its pipe close or its parent change and exits. They ignore SIGINT, which the parent handles.
What a scorer prints goes to a per-worker file, not the terminal; its last ``OUTPUT_TAIL`` bytes
come back with the error of a failed completion.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections import deque
from multiprocessing.connection import wait
from pathlib import Path

from ..processes import die_with_parent
from .objects import is_object, lookup
from .scorers import ScoreResult, get, groups, one_line, record, score_local, score_unit, stopped_early

OUTPUT_TAIL = 2048  # bytes of a failing scorer's stdout/stderr kept for the error message
# a new worker's start (imports, its scorer's libraries) may take this long beyond a completion's time limit; a
# worker that hangs while starting is still replaced after it
WORKER_START_S = 60.0
STARTING_POLL_S = 0.05  # how often the parent looks whether a starting worker is ready

# Parent ends of every live worker pipe in this process. A forked worker inherits them all and
# must close them: a worker holding another worker's parent end keeps that pipe open after the
# parent dies, and the other worker would never see end-of-file.
_PARENT_ENDS: set = set()


def _read_tail(fd: int | None) -> str:
    if fd is None:
        return ""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, min(size, OUTPUT_TAIL), max(0, size - OUTPUT_TAIL)).decode("utf-8", "replace")
    except OSError:
        return ""


def _with_output(cause: str, output: str) -> str:
    output = one_line(output, 200)
    return f"{cause}; scorer output: {output}" if output else cause


def _redirect_output(out_fd: int | None) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C code too) to ``out_fd``."""
    if out_fd is None:
        return
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    # New text streams: the inherited ones may hold the parent's unflushed output.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def _rewind_output(out_fd: int | None) -> str:
    """Flush, return the tail of what the last completion's scorer printed, and empty the file (bounded size)."""
    if out_fd is None:
        return ""
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    tail = _read_tail(out_fd)
    os.ftruncate(out_fd, 0)
    os.lseek(out_fd, 0, os.SEEK_SET)  # fds 1, 2 and out_fd share this offset
    return tail


def _worker(name: str, conn, parent_end, parent_pid: int, out_fd: int | None, progress) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent around start()
    for c in [parent_end, *_PARENT_ENDS]:
        c.close()
    die_with_parent(parent_pid)
    _redirect_output(out_fd)

    try:
        scorer, load_error = get(name), None
        warm_up = getattr(scorer, "warm_up", None)
        if warm_up is not None:  # the libraries a scorer loads on first use (math-verify's sympy), before any clock
            warm_up()
    except BaseException as e:  # noqa: BLE001 - reported with every completion instead of a silent death
        scorer, load_error = None, one_line(f"{type(e).__name__}: {e}")
    progress[2] = 1.0  # ready: from now on a completion's time is its own
    _rewind_output(out_fd)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or died
            return
        if msg is None:
            return
        results = []
        for k, (completions, references, contexts) in enumerate(msg):
            # start time before position: the parent reads the position first, so it never pairs a
            # new position with the previous unit's (earlier) start and times it out early
            progress[1] = time.monotonic()
            progress[0] = k
            if scorer is None:
                outcomes = [(0.0, "error", f"the scorer failed to load in the worker: {load_error}")] * len(completions)
                logged = None
            else:  # the same checks as in-process
                outcomes, logged = score_unit(scorer, completions, references, contexts)
            output = _rewind_output(out_fd)
            results.append(([(v, status, _with_output(cause, output) if status == "error" else None)
                             for v, status, cause in outcomes], logged))
        conn.send(results)


class _Worker:
    def __init__(self, ctx, name: str):
        self.conn, child = ctx.Pipe()
        forked = ctx.get_start_method() == "fork"
        # Only a forked child inherits this descriptor; a spawned one leaves its output on the terminal.
        self.out = tempfile.TemporaryFile() if forked else None
        out_fd = self.out.fileno() if self.out else None
        # [position in the chunk, monotonic start time] of the completion being scored, and 1 once the worker has
        # loaded its scorer; no lock: a worker killed while holding one would block the parent
        self.progress = ctx.RawArray("d", 3)
        self.proc = ctx.Process(target=_worker, args=(name, child, self.conn, os.getpid(), out_fd, self.progress),
                                daemon=True)
        # SIGINT stays blocked from fork until the child ignores it, so a Ctrl-C in between cannot
        # print a KeyboardInterrupt traceback from the child. The mask is per thread and restored.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") else None
        try:
            self.proc.start()
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        _PARENT_ENDS.add(self.conn)
        self.job: list[int] | None = None  # unit indices of the chunk in flight
        self.sizes: list[int] = []  # completions in each of them

    def send(self, job: list[int], units: list[list[int]], completions: list[str], references: list[str],
             contexts: list[dict] | None) -> None:
        """Send a chunk of units; its first unit's clock starts now (the worker restarts it per unit).

        Raises:
            OSError: the worker's pipe is closed (it died while idle).
        """
        self.progress[0], self.progress[1] = 0, time.monotonic()
        self.conn.send([([completions[i] for i in units[u]], [references[i] for i in units[u]],
                         None if contexts is None else [contexts[i] for i in units[u]]) for u in job])
        self.job, self.sizes = job, [len(units[u]) for u in job]

    def current(self, timeout_s: float) -> tuple[int, float]:
        """(position in the chunk, deadline) of the unit this worker is scoring: ``timeout_s`` per completion."""
        k = min(int(self.progress[0]), len(self.sizes) - 1)
        starting = 0.0 if self.progress[2] else WORKER_START_S  # a chunk sent before the worker was ready
        return k, self.progress[1] + timeout_s * self.sizes[k] + starting

    def output(self) -> str:
        """The tail of what the scorer printed during the current completion (for a worker that died or hung)."""
        return _read_tail(self.out.fileno()) if self.out else ""

    def close(self, kill: bool) -> None:
        if kill:
            self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(1)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc.join(5)
        _PARENT_ENDS.discard(self.conn)
        self.conn.close()
        if self.out:
            self.out.close()


def read_in_process_marker(path: str | os.PathLike) -> str | None:
    """The one-line warning an ``in_process_marker`` left by a process that died while scoring, or None; removes it.

    The marker is a file, not an ``atexit`` hook, because ``os._exit``, a crash and SIGKILL run none:
    only a file left behind tells the next start (a resume of the run) what ended the last one.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    try:
        info = json.loads(text)
    except ValueError:  # cut short by the death it reports
        info = {}
    if not isinstance(info, dict):
        info = {}
    path.unlink(missing_ok=True)
    since = info.get("since")
    when = f", a call from {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, (int, float)) else ""
    return (f"warning: the last start of this run (pid {info.get('pid', '?')}) ended while its scorer "
            f"{info.get('scorer', '?')!r} ran in the trainer's process (reward.workers=0{when}), leaving no message: the "
            "scorer called os._exit or crashed the interpreter, or the process was killed; reward.workers=2 scores "
            "in worker processes, where such a failure is counted and reported")


class RewardPool:
    """Score completions with the scorer ``name`` in ``workers`` processes, each call limited to ``timeout_s`` seconds.

    ``workers=0`` scores in this process with the same parsing (``rewards.get``) and no time limit: a scorer
    that exits or hangs there takes the caller with it. Set ``in_process_marker`` to a path to have a file
    there for the duration of each in-process ``score`` call (removed when it returns or raises): a file
    still there at the next start means the process died inside the scorer (``read_in_process_marker``).
    ``chunk_size`` completions go to a worker in one message (module docstring). ``clamp``: a reward outside
    [0, 1] is clamped into it and counted (a task's scorer), or kept as returned (a reward function of
    ``functions.WeightedRewards``); ``scorers.settle``.
    Use as a context manager, or call ``close``. Workers start lazily, from the thread that calls
    ``score``; on Linux a worker is killed when that thread ends, so score from a thread that
    outlives the pool (the main thread, or a long-lived scoring thread).

    Raises:
        UserError: at construction, if ``name`` is not a known scorer or its module fails to
            import (checked in this process first).
    """

    def __init__(self, name: str, *, workers: int = 2, timeout_s: float = 10.0, chunk_size: int = 32,
                 clamp: bool = True):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        # a Python object (rewards.objects) lives in this process only: it is scored here, whatever ``workers`` says
        workers = 0 if is_object(name) else workers
        self.name, self.workers, self.timeout_s, self.chunk_size = name, workers, timeout_s, chunk_size
        self.clamp = clamp
        self._local = lookup(name) if is_object(name) else get(name)  # fails fast, in this process, in one line
        # fork: a worker needs no re-import of __main__ (spawn would re-run an unguarded user script);
        # it never touches torch, so the parent's OpenMP threads do not matter.
        self._ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._pool: list[_Worker] = []
        self.in_process_marker: Path | None = None  # workers=0 only (class docstring)

    def _ensure_workers(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._ctx, self.name))

    def score(self, completions: list[str], references: list[str], *, contexts: list[dict] | None = None,
              max_failure_rate: float | None = None) -> ScoreResult:
        """Rewards for ``completions[i]`` against ``references[i]``, in order; failures give 0 and are counted.

        ``contexts[i]`` (optional) is the prompt text and data row of completion i (``{"prompt": ..., **columns}``,
        and ``GROUP_KEY``); only a batch-form scorer (``scorers.BatchForm``, one call per group) reads it.
        With ``max_failure_rate``, scoring stops as soon as the failures (errors + timeouts) exceed that
        fraction of all ``completions`` (``scorers.stopped_early``: ``check_scoring`` at that rate refuses
        the call whatever the rest would score), so a scorer that always times out costs about
        ``max_failure_rate · len(completions) · timeout_s / workers`` seconds, not the whole call. The
        completions not scored get reward 0 and are counted in ``unscored``; busy workers are killed.

        Raises:
            ValueError: the lists differ in length (a caller's bug).
        """
        if len(completions) != len(references) or (contexts is not None and len(contexts) != len(references)):
            raise ValueError(f"{len(completions)} completions but {len(references)} references"
                             + ("" if contexts is None else f" and {len(contexts)} contexts"))
        if self.workers == 0:
            return self._score_in_process(completions, references, contexts, max_failure_rate)
        self._ensure_workers()
        res = ScoreResult([0.0] * len(completions), 0, 0)
        units = groups(self._local, contexts, len(completions))
        # about chunk_size completions per message, and a chunk per worker at least, so that both share a small call
        widest = max((len(u) for u in units), default=1)
        size = max(1, min(self.chunk_size // widest, -(-len(units) // self.workers)))
        todo = deque(range(len(units)))
        while todo or any(w.job for w in self._pool):
            if stopped_early(res.errors + res.timeouts, len(completions), max_failure_rate):
                res.unscored = sum(len(units[u]) for u in todo) + sum(sum(w.sizes) for w in self._pool if w.job)
                for w in [w for w in self._pool if w.job]:  # mid-chunk: its results would arrive late, unasked
                    w.close(kill=True)
                    self._pool.remove(w)
                break
            for k, w in enumerate(list(self._pool)):
                if w.job is None and todo:
                    job = [todo[j] for j in range(min(size, len(todo)))]
                    try:
                        w.send(job, units, completions, references, contexts)
                    except OSError:  # the worker died while idle (e.g. the OOM killer): replace it, retry
                        w.close(kill=True)
                        self._pool[k] = _Worker(self._ctx, self.name)
                        continue
                    for _ in job:
                        todo.popleft()
            busy = [w for w in self._pool if w.job]
            if busy:
                self._collect(busy, res, todo, units)
        return res

    def _score_in_process(self, completions: list[str], references: list[str], contexts: list[dict] | None,
                          max_failure_rate: float | None) -> ScoreResult:
        if self.in_process_marker is None:
            return score_local(self._local, completions, references, contexts=contexts,
                               max_failure_rate=max_failure_rate, clamp=self.clamp)
        marker = Path(self.in_process_marker)
        try:  # a write the disk refuses leaves no empty marker to be read as a crash in the scorer
            marker.write_text(json.dumps({"pid": os.getpid(), "scorer": self.name, "since": time.time()}))
            return score_local(self._local, completions, references, contexts=contexts,
                               max_failure_rate=max_failure_rate, clamp=self.clamp)
        finally:  # not reached on os._exit, a crash or SIGKILL: the file then stays, as intended
            marker.unlink(missing_ok=True)

    def _collect(self, busy: list[_Worker], res: ScoreResult, todo: deque, units: list[list[int]]) -> None:
        """Wait for the first busy worker to answer or pass its deadline; record what came back in ``res``.

        A worker that died or timed out is replaced: its current unit keeps reward 0 (each completion counted), the
        rest of its chunk goes back to the front of ``todo``.
        """
        next_deadline = min(w.current(self.timeout_s)[1] for w in busy)
        if not all(w.progress[2] for w in busy):  # a worker still starting: look again soon, its limit starts then
            next_deadline = min(next_deadline, time.monotonic() + STARTING_POLL_S)
        ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
        for k, w in enumerate(list(self._pool)):
            if w.job is None:
                continue
            if w.conn in ready:
                try:
                    results = w.conn.recv()
                except (EOFError, OSError):  # the scorer took its process down
                    res.errors += w.sizes[w.current(self.timeout_s)[0]]
                    w.proc.join(1)
                    code = "unknown" if w.proc.exitcode is None else w.proc.exitcode
                    res.last_error = _with_output(f"the scorer's process died (exit code {code})", w.output())
                else:
                    for u, (outcomes, logged) in zip(w.job, results):
                        record(res, units[u], outcomes, self.clamp, logged)
                    w.job = None
                    continue
            elif time.monotonic() < w.current(self.timeout_s)[1]:
                continue
            else:
                res.timeouts += w.sizes[w.current(self.timeout_s)[0]]
                res.last_error = _with_output(f"the scorer ran past reward.timeout_s={self.timeout_s:g} s", w.output())
            failed = w.current(self.timeout_s)[0]
            todo.extendleft(reversed(w.job[:failed] + w.job[failed + 1:]))
            w.close(kill=True)
            self._pool[k] = _Worker(self._ctx, self.name)

    def close(self) -> None:
        """Stop the workers (each gets 1 s to exit, then is killed)."""
        for w in self._pool:
            w.close(kill=False)
        self._pool.clear()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
