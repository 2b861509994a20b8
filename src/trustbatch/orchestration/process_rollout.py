"""Rollout workers in spawned processes on this machine: the process transport of ``pipeline.async_source``.

After each round the learner copies its state into a shared-memory copy of the named tensors, the slot of the
round it asks for next (``ProcessTransport.push``): one slot in latest order, ``ahead + 1`` (the rounds that
may still sample a batch) in deterministic order. A worker loads its batch's slot (the newest, or round
``behaviour_round(j, ahead, floor)``'s) with its engine's ``load_weights`` when the version differs from the
one it holds. Workers claim batch indices from a shared counter and evaluate the capacity rule themselves, so
one that finishes while the learner trains starts the next allowed batch at once.

The rules (batch order, capacity bound, drop rule, restarts, metrics) are ``BoundedSource``'s. Process workers
ignore Ctrl-C, die with the trainer (``processes.die_with_parent``), and ``close`` stops and reaps them.

A worker killed at any moment (the OOM killer) must not hang the learner: each sends its messages on a pipe of its
own, whose write end only it holds, so its death reads as the end of that pipe (a shared queue left half a message
and its write lock behind: the learner blocked reading it); and the learner takes the weights lock with a timeout,
releasing it for a worker that died holding it (``_Shared.holder``); the restart of a worker that died holding the
claim lock releases that (``_Shared.claim_holder``). A worker killed between taking a lock and writing itself its
holder (a few bytecodes) still leaves the lock held: not covered.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import threading
import time
from multiprocessing.connection import wait as wait_for

import torch
import torch.multiprocessing as mp

from ..pipeline.async_source import BoundedSource, Message, describe_error, order_ahead
from ..pipeline.staleness import behaviour_round, may_start
from ..pipeline.weight_sync import Stateless, host_weights
from .rollout_worker import RolloutWorker, WorkerSpec, for_start, save_worker_model


class _Shared:
    """The state learner and workers share: weight slots by round, the capacity gate, the batch counter."""

    def __init__(self, ctx, model: torch.nn.Module, version: int, n_workers: int, k: int, slots: int):
        self.weights = [{name: t.clone().share_memory_() for name, t in host_weights(model)}
                        for _ in range(slots)]
        self.slot_round = ctx.Array("q", [-1] * slots, lock=False)  # the round whose weights each slot holds
        self.slot_version = ctx.Array("q", [version] * slots, lock=False)
        self.floor = ctx.Value("q", 0, lock=False)  # the oldest round held (staleness.behaviour_round)
        self.weights_lock = ctx.Lock()
        self.holder = ctx.Value("q", -1, lock=False)  # the worker that holds weights_lock, or -1
        self.requested = ctx.Value("q", 0, lock=False)  # the batch index the learner asks for now
        self.k = ctx.Value("q", k, lock=False)  # the current staleness bound, in versions
        self.next_index = ctx.Value("q", 0, lock=False)
        self.claim_lock = ctx.Lock()
        self.claim_holder = ctx.Value("q", -1, lock=False)  # the worker that holds claim_lock, or -1
        self.claimed = ctx.Array("q", [-1] * n_workers, lock=False)
        self.started = ctx.Array("d", [0.0] * n_workers, lock=False)  # when each began its batch; 0: not making one
        self.stop = ctx.Event()


class _Sender:
    """A worker's messages to the learner, each pickled whole (plain pickle copies the tensors into the message:
    torch's queue pickler would pass them as file descriptors, lost if the worker is killed before they are read),
    written by a thread so that the worker goes on while a large batch drains into the pipe. ``close`` sends what
    is queued."""

    def __init__(self, conn):
        self.conn, self.pending = conn, queue.Queue()
        self.thread = threading.Thread(target=self._send, daemon=True, name="trustbatch-sender")
        self.thread.start()

    def put(self, message: tuple) -> None:
        self.pending.put(pickle.dumps(message))

    def _send(self) -> None:
        while (data := self.pending.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the learner closed its end: it is stopping
                return

    def close(self) -> None:
        self.pending.put(None)
        self.thread.join()
        self.conn.close()


def _slot_for(j: int, shared: _Shared, ahead: int | None) -> int:
    """The slot whose weights sample batch ``j`` (under ``weights_lock``); −1: its round's slot already holds a
    later round, so batch ``j`` has been trained on (a restarted worker's duplicate) and is not made."""
    if ahead is None:
        return 0
    want = behaviour_round(j, ahead, shared.floor.value)
    slot = want % len(shared.weights)
    held = shared.slot_round[slot]
    if held < want:  # the learner publishes round b before it lets batch b + ahead start
        raise RuntimeError(f"batch {j} started before the weights of round {want} were published")
    return slot if held == want else -1


def _claim(wid: int, shared: _Shared) -> int:
    """The next batch index, claimed by worker ``wid``: ``claimed[wid]`` is written before the counter moves on, so a
    worker killed in between holds the index (its restart makes it; at worst another worker makes it too), where
    the other order left an index no worker held, which the learner waited for for good."""
    with shared.claim_lock:
        shared.claim_holder.value = wid
        j = shared.next_index.value
        shared.claimed[wid] = j
        shared.next_index.value = j + 1
        shared.claim_holder.value = -1
    return j


def _worker_main(wid: int, spec: WorkerSpec, shared: _Shared, steps_per_round: int, ahead: int | None, first: int,
                 parent: int, conn) -> None:
    from ..processes import die_with_parent

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and stops us
    out = _Sender(conn)
    try:
        _make_batches(wid, spec, shared, steps_per_round, ahead, first, out)
    finally:
        out.close()


def _make_batches(wid: int, spec: WorkerSpec, shared: _Shared, steps_per_round: int, ahead: int | None, first: int,
                  out: _Sender) -> None:
    try:
        worker = RolloutWorker(spec)
    except BaseException as e:  # report why, then exit: the learner raises it
        out.put(("error", wid, -1, describe_error(e)))
        return
    j, loaded = first, None  # the version this worker's engine holds; None: the model directory's (load once)
    try:
        while not shared.stop.is_set():
            if j < 0:
                j = _claim(wid, shared)
            shared.claimed[wid] = j
            while not (shared.stop.is_set() or may_start(j, shared.requested.value, shared.k.value, steps_per_round)):
                time.sleep(0.002)
            if shared.stop.is_set():
                break
            with shared.weights_lock:
                shared.holder.value = wid
                try:
                    slot = _slot_for(j, shared, ahead)
                    if slot >= 0 and shared.slot_version[slot] != loaded:
                        loaded = shared.slot_version[slot]
                        worker.load_weights(shared.weights[slot].items(), loaded)
                finally:
                    shared.holder.value = -1
            if slot < 0:
                j = -1
                continue
            shared.started[wid] = time.time()
            batch, metrics = worker.make_batch(j)
            out.put(("batch", wid, j, (batch, metrics)))
            shared.started[wid] = 0.0
            j = -1
    except BaseException as e:
        out.put(("error", wid, j, describe_error(e)))
    finally:
        worker.close()


class ProcessTransport(Stateless):
    """Rollout workers in spawned processes on this machine; weights and gate in shared memory.

    Args:
        spec: what each worker builds (``spec.model_dir`` already written).
        model: the learner's module (its current tensors are the workers' first weights).
        version: the learner's policy version now.
        workers: processes (one torch thread each).
        steps_per_round: optimizer steps per batch, for the capacity rule.
        ahead: deterministic order (``async_source.order_ahead``): keep ``ahead + 1`` rounds' weights, one
            shared copy of the policy each; None: one copy, the newest.

    The bound starts at 0 (nothing runs ahead) until the first ``request`` sets it.
    """

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module, *, version: int, workers: int,
                 steps_per_round: int, ahead: int | None = None):
        self.ctx = mp.get_context("spawn")
        self.spec, self.n, self.m, self.ahead = spec, workers, steps_per_round, ahead
        self.shared = _Shared(self.ctx, model, version, workers, 0, 1 if ahead is None else ahead + 1)
        self.procs: list = [None] * workers
        self.readers: list = [None] * workers  # each worker's pipe (read end); a restarted one's old pipe drains
        self._draining: list = []
        self.first = [-1] * workers  # the batch a restarted worker makes first, until it claims it itself
        self.requested = 0
        self.starts = 0  # worker processes started so far, restarts included (``for_start``)
        self._preloaded: dict = {}

    def _start(self, wid: int, first: int = -1) -> None:
        spec, self.starts = for_start(self.spec, self.starts), self.starts + 1
        reader, writer = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_worker_main, args=(wid, spec, self.shared, self.m, self.ahead, first,
                                                        os.getpid(), writer),
                             daemon=False, name=f"trustbatch-rollout-{wid}")  # it owns a reward pool
        p.start()
        writer.close()  # the worker's alone: its death ends the pipe
        if self.readers[wid] is not None:
            self._draining.append(self.readers[wid])  # what the old process sent whole is still read
        self.procs[wid], self.readers[wid] = p, reader

    @contextlib.contextmanager
    def _weights_locked(self):
        """``weights_lock``, taken with a timeout: a worker killed while it held the lock (loading a round's
        weights) would block the learner for good; the lock is released on its behalf, and the health check
        restarts it."""
        sh = self.shared
        while not sh.weights_lock.acquire(timeout=1.0):
            wid = sh.holder.value
            if wid >= 0 and self.procs[wid] is not None:
                self._release_for_dead(wid, self.procs[wid])
        try:
            yield
        finally:
            sh.weights_lock.release()

    def _release_for_dead(self, wid: int, proc) -> None:
        """Release ``weights_lock`` and ``claim_lock`` on behalf of worker ``wid`` where it holds them and its process
        ``proc`` is dead."""
        sh = self.shared
        for holder, lock in ((sh.holder, sh.weights_lock), (sh.claim_holder, sh.claim_lock)):
            if holder.value == wid and not proc.is_alive():
                holder.value = -1
                lock.release()

    def _put(self, round_: int, version: int, weights) -> None:
        """Round ``round_``'s weights into its slot (under ``weights_lock``)."""
        slot = round_ % len(self.shared.weights)
        for name, t in weights:
            self.shared.weights[slot][name].copy_(t)
        self.shared.slot_round[slot] = round_
        self.shared.slot_version[slot] = version

    def start(self, first_index: int) -> None:
        sh = self.shared
        with self._weights_locked():  # every slot holds the first weights; the first round is the newest
            sh.slot_round[first_index % len(sh.weights)] = first_index
            floor = first_index
            for r in range(first_index - 1, first_index - len(sh.weights), -1):
                if r not in self._preloaded:
                    break
                version, state = self._preloaded[r]
                self._put(r, version, state.items())
                floor = r
            sh.floor.value = floor
        self.requested = sh.requested.value = sh.next_index.value = first_index
        for wid in range(self.n):
            self._start(wid)

    def request(self, b: int, k: int) -> None:
        sh = self.shared
        with self._weights_locked():
            slot, prev = b % len(sh.weights), (b - 1) % len(sh.weights)
            if sh.slot_round[slot] != b:  # no push since round b − 1 (a batch skipped or dropped): its weights
                if slot != prev:
                    self._put(b, sh.slot_version[prev], sh.weights[prev].items())
                sh.slot_round[slot] = b
        sh.k.value = k
        self.requested = sh.requested.value = b  # after the weights: a worker may start batch b + ahead now

    def poll(self, timeout_s: float) -> Message | None:
        conns = [c for c in (*self._draining, *self.readers) if c is not None]
        for conn in wait_for(conns, timeout_s):
            try:
                return pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # its process ended (mid-message, if it was killed): the health check
                self._forget(conn)       # restarts it; what it sent whole was read before
        return None

    def _forget(self, conn) -> None:
        conn.close()
        if conn in self._draining:
            self._draining.remove(conn)
        self.readers = [None if c is conn else c for c in self.readers]

    def held(self, wid: int) -> int:
        claimed = self.shared.claimed[wid]
        return claimed if claimed >= 0 else self.first[wid]

    def alive(self, wid: int) -> bool:
        return self.procs[wid].is_alive()

    def busy_since(self, wid: int) -> float | None:
        return self.shared.started[wid] or None

    def restart(self, wid: int, first: int) -> str:
        p = self.procs[wid]
        if p.is_alive():
            p.kill()
        p.join(5)
        self._release_for_dead(wid, p)  # it died loading weights: its replacement needs the lock
        # the new process claims ``first`` once it has started; until then it holds nothing
        self.shared.claimed[wid] = -1
        self.shared.started[wid] = 0.0
        self.first[wid] = first
        self._start(wid, first)
        return f"exited with code {p.exitcode}"

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Copy the state into the next round's slot (under the lock workers load under). Its previous round
        samples no batch still to make: the batches up to the one just trained on are all made."""
        with self._weights_locked():
            self._put(self.requested + 1, version, host_weights(model))

    def snapshots(self, rounds: range) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
        sh, out = self.shared, {}
        with self._weights_locked():
            for r in rounds:
                slot = r % len(sh.weights)
                if sh.slot_round[slot] == r:
                    out[r] = (int(sh.slot_version[slot]), {n: t.clone() for n, t in sh.weights[slot].items()})
        return out

    def preload(self, snapshots: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
        self._preloaded = dict(snapshots)

    def close(self) -> None:
        self.shared.stop.set()
        for conn in [*self._draining, *self.readers]:  # first: a worker sending a batch made ahead then ends
            if conn is not None:
                conn.close()
        self._draining, self.readers = [], [None] * self.n
        for p in self.procs:
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)


class AsyncSource(BoundedSource):
    """Rollout workers in spawned processes that run ahead of the learner by at most ``max_staleness`` versions.

    Args:
        spec: what each worker builds (the policy is written to a temporary HF directory for it).
        policy: the learner's policy (its current weights are the workers' first weights).
        version: the learner's policy version now.
        workers: rollout processes (one torch thread each).
        max_staleness: k in policy versions, or "auto" (``StalenessController``, starting at 1).
        steps_per_round: optimizer steps the learner takes per batch (epochs × minibatches).
        worker_timeout_s: a worker that has been making the awaited batch this long is restarted.
        async_order: "deterministic" (batch b sampled by round ``b − floor(k / steps_per_round)``'s weights;
            ``staleness.behaviour_round``) or "latest" (the newest weights when a worker starts it).

    Raises:
        UserError: from ``next_batch``, when a worker fails for a reason the user must fix (a scorer
            over its failure limit, a model that does not load).
    """

    def __init__(self, spec: WorkerSpec, policy, *, version: int, workers: int = 1, max_staleness: int | str = 0,
                 steps_per_round: int = 1, worker_timeout_s: float = 300.0, async_order: str = "deterministic"):
        model_dir = save_worker_model(spec, policy)
        transport = ProcessTransport(spec, policy.model, version=version, workers=workers,
                                     steps_per_round=steps_per_round,
                                     ahead=order_ahead(async_order, max_staleness, steps_per_round))
        super().__init__(transport, max_staleness=max_staleness, worker_timeout_s=worker_timeout_s,
                         model_dir=model_dir)
