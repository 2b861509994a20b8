"""Scoring in worker processes with a per-completion time limit, so that no scorer can stall or crash a run.

A scorer that raises, returns a non-finite value, kills its process or runs past ``timeout_s``
gives reward 0; the pool counts each case, replaces a dead or hung worker, and goes on.
Workers build the scorer from its name (``rewards.get``), so user functions need only be importable.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait


@dataclass
class ScoreResult:
    rewards: list[float]  # one per completion, in [0, 1]
    errors: int  # scorer raised, returned a non-finite value, or its process died
    timeouts: int  # scorer ran past the time limit


def _worker(name: str, conn) -> None:
    from . import get, score_all

    scorer = get(name)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        i, completion, reference = msg
        (v,), errors = score_all(scorer, [completion], [reference])  # same validation and clamping in-process
        conn.send((i, v, errors == 0))


class _Worker:
    def __init__(self, ctx, name: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(name, child), daemon=True)
        self.proc.start()
        child.close()
        self.job: tuple[int, float] | None = None  # (completion index, deadline)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """Score completions with the scorer ``name`` in ``workers`` processes, each call limited to ``timeout_s`` seconds.

    ``workers=0`` scores in this process with the same parsing (``rewards.get``) and no time limit.
    Use as a context manager, or call ``close``.

    Raises:
        UserError: at construction, if ``name`` is not a known scorer (checked in this process first).
    """

    def __init__(self, name: str, *, workers: int = 2, timeout_s: float = 10.0):
        from . import get

        self.name, self.workers, self.timeout_s = name, workers, timeout_s
        self._local = get(name)  # fails fast, in this process, with a one-line error
        # fork: a worker needs no re-import of __main__ (spawn would re-run an unguarded user script);
        # it never touches torch, so the parent's OpenMP threads do not matter.
        self._ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._pool: list[_Worker] = []

    def _ensure_workers(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._ctx, self.name))

    def score(self, completions: list[str], references: list[str]) -> ScoreResult:
        """Rewards for ``completions[i]`` against ``references[i]``, in order."""
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        if self.workers == 0:
            from . import score_all

            rewards, errors = score_all(self._local, completions, references)
            return ScoreResult(rewards, errors, 0)
        self._ensure_workers()
        out = [0.0] * len(completions)
        errors = timeouts = 0
        todo = deque(range(len(completions)))
        while todo or any(w.job for w in self._pool):
            for w in self._pool:
                if w.job is None and todo:
                    i = todo.popleft()
                    w.conn.send((i, completions[i], references[i]))
                    w.job = (i, time.monotonic() + self.timeout_s)
            busy = [w for w in self._pool if w.job]
            next_deadline = min(w.job[1] for w in busy)
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for k, w in enumerate(list(self._pool)):
                if w.job is None:
                    continue
                if w.conn in ready:
                    try:
                        i, v, ok = w.conn.recv()
                        out[i] = v
                        errors += not ok
                        w.job = None
                        continue
                    except (EOFError, OSError):  # the scorer took its process down
                        errors += 1
                elif time.monotonic() < w.job[1]:
                    continue
                else:
                    timeouts += 1
                w.kill()
                self._pool[k] = _Worker(self._ctx, self.name)
        return ScoreResult(out, errors, timeouts)

    def close(self) -> None:
        for w in self._pool:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.proc.join(1)
            if w.proc.is_alive():
                w.proc.kill()
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
