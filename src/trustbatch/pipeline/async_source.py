"""The asynchronous rollout source: rollout workers run ahead of the learner by at most k policy versions.

Same protocol as ``SyncSource``, so the loop cannot tell them apart. Each worker (one torch thread)
holds a ``RolloutWorker`` (engine, reward pool, batch maker) and makes whole batches: batch ``b``'s
prompts and random streams depend only on (seed, b), so a worker makes exactly the batch the sync
source would, with the newest weights it has. With ``max_staleness=0`` the pipeline runs in lockstep
and reproduces the sync source bit for bit (same threads); with k > 0 a worker starts batch ``b`` as soon
as the capacity rule of ``pipeline.staleness`` allows, while the learner trains on earlier ones.

The module is split in two, so that the rules exist once whatever carries the batches:

- ``BoundedSource``: batch order, the capacity bound k (fixed or ``StalenessController``), the drop
  rule, restarts of dead or hung workers, learner wait time and the round's metrics, checkpoint state.
- a ``Transport``: where the workers run and how weights and batches travel. ``ProcessTransport``
  (here): spawned processes, weights in shared memory. ``orchestration.ray_rollout.RayTransport``:
  Ray actors, weights through Ray's object store.

``ProcessTransport``: after each round the learner copies its state into one shared-memory copy of
the named tensors and bumps a shared version (``SharedMemorySync.push``); a worker loads them with its
engine's ``load_weights`` before each batch when the version moved. Workers claim batch indices from a
shared counter and evaluate the capacity rule themselves, so one that finishes while the learner
trains starts the next allowed batch at once.

Faults: a worker that dies, or has been making the batch the learner waits for longer than
``worker_timeout_s``, is killed and restarted on the batch it held (counted in ``worker_restarts``).
The time counts from when the worker began the batch, so a restarted worker's start-up (seconds: torch,
the model) is never taken for a hang. Process workers ignore
Ctrl-C, die with the trainer (``processes.die_with_parent``), and ``close`` stops and reaps them.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from typing import Protocol

import torch
import torch.multiprocessing as mp

from ..errors import UserError
from ..orchestration.rollout_worker import RolloutWorker, WorkerSpec
from .batch import TrainBatch
from .staleness import StalenessController, may_start, too_stale
from .weight_sync import named_weights


_MAX_RESTARTS_WITHOUT_BATCH = 3  # per worker: beyond this a worker cannot start at all (a crash loop)
_POLL_S = 0.2  # how long the learner waits for a message before it checks the workers' health

# A transport's message: ("batch", wid, j, (batch, metrics)) or ("error", wid, j, (is_user_error, text)).
Message = tuple[str, int, int, tuple]


class Transport(Protocol):
    """Where rollout workers run and how weights and batches travel; ``BoundedSource`` holds the rules.

    Worker ids are ``0 … n − 1``; batch indices count from 0 over the whole run.
    """

    n: int

    def start(self, first_index: int) -> None:
        """Start all workers; the first batch to make is ``first_index`` (after a resume, not 0)."""
        ...

    def request(self, b: int, k: int) -> None:
        """The learner now waits for batch ``b`` under bound ``k``: batches ``j`` with
        ``may_start(j, b, k, steps_per_round)`` may start."""
        ...

    def poll(self, timeout_s: float) -> Message | None:
        """The next finished batch or worker error, waiting at most ``timeout_s`` seconds; None if none."""
        ...

    def held(self, wid: int) -> int:
        """The batch index worker ``wid`` is making or waiting to start, or −1."""
        ...

    def alive(self, wid: int) -> bool:
        ...

    def busy_since(self, wid: int) -> float | None:
        """When (``time.time()``) worker ``wid`` began making the batch it holds; None while it starts
        up or waits for the capacity rule."""
        ...

    def restart(self, wid: int, first: int) -> str:
        """Kill worker ``wid`` (if alive) and start a new one whose first batch is ``first`` (−1: the
        next unclaimed one). Returns how the old one ended, for error messages."""
        ...

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Weight sync: make ``model``'s named tensors, policy ``version``, the workers' next weights."""
        ...

    def close(self) -> None:
        """Stop every worker and release what the transport holds; safe to call twice."""
        ...


def describe_error(e: BaseException) -> tuple[bool, str]:
    """(is a UserError, message): a scorer limit keeps its one line; anything else carries its traceback."""
    if isinstance(e, UserError):
        return True, str(e)
    return False, "".join(traceback.format_exception(e)).strip()


class BoundedSource:
    """Rollout workers that run ahead of the learner by at most ``max_staleness`` policy versions.

    The rules (module docstring) over a ``Transport``; ``AsyncSource`` and ``ray_rollout.ray_source``
    build one.

    Args:
        transport: the workers (constructed, not yet started; ``start`` runs on the first ``next_batch``).
        max_staleness: k in policy versions, or "auto" (``StalenessController``, starting at 1).
        worker_timeout_s: a worker that has been making the awaited batch this long is restarted.
        model_dir: the workers' model directory (``save_worker_model``), removed by ``close``.

    Raises:
        UserError: from ``next_batch``, when a worker fails for a reason the user must fix (a scorer
            over its failure limit, a model that does not load).
        RuntimeError: from ``next_batch``, another worker failure, or workers that keep dying before
            they make a batch.
    """

    def __init__(self, transport: Transport, *, max_staleness: int | str = 0, worker_timeout_s: float = 300.0,
                 model_dir: str | None = None):
        self.transport = transport
        self.sync = transport  # the loop's WeightSync: ``push(model, version)``
        self.controller = StalenessController() if max_staleness == "auto" else None
        self.k = self.controller.k if self.controller else int(max_staleness)
        self.n = transport.n
        self.timeout = worker_timeout_s
        self.model_dir = model_dir
        self._started = False
        self.batch_index = 0
        self.buffer: dict[int, tuple] = {}
        self.restarts = 0
        self._restarts_without_batch = 0
        self.dropped = 0
        self.last_metrics: dict[str, float] = {}
        self._wait_s = 0.0
        self._round_t0: float | None = None
        self._last_ess: float | None = None
        # run by ``close`` after the transport's: parts that share its workers' lifetime (Ray learner ranks)
        self.on_close: list = []

    # ---- worker health ----------------------------------------------------------------------------
    def _restart(self, wid: int) -> None:
        held = self.transport.held(wid)
        self.restarts += 1
        self._restarts_without_batch += 1
        ended = self.transport.restart(wid, held if held >= 0 and held not in self.buffer else -1)
        if self._restarts_without_batch > _MAX_RESTARTS_WITHOUT_BATCH * self.n:
            raise RuntimeError(f"rollout workers keep dying before making a batch (worker {wid} {ended}); "
                               "their stderr above says why")

    def _check_workers(self, waiting_for: int) -> None:
        """Restart dead workers, and the one hung on the awaited batch."""
        for wid in range(self.n):
            since = self.transport.busy_since(wid)
            hung = self.transport.held(wid) == waiting_for and since is not None and time.time() - since > self.timeout
            if hung or not self.transport.alive(wid):
                self._restart(wid)

    # ---- the protocol -----------------------------------------------------------------------------
    def next_batch(self, learner_version: int) -> TrainBatch | None:
        if not self._started:
            self.transport.start(self.batch_index)
            self._started = True
        now = time.time()
        round_s = now - self._round_t0 if self._round_t0 is not None else 0.0
        if self.controller is not None and self._round_t0 is not None:
            self.k = self.controller.update(self._last_ess, self._wait_s, round_s)
        self._round_t0 = now
        wait = 0.0
        while True:
            b = self.batch_index
            self.transport.request(b, self.k)
            t0 = time.time()
            while b not in self.buffer:
                msg = self.transport.poll(_POLL_S)
                if msg is None:
                    self._check_workers(b)
                    continue
                kind, wid, j, payload = msg
                if kind == "error":
                    is_user, text = payload
                    raise UserError(text) if is_user else RuntimeError(f"rollout worker {wid} failed:\n{text}")
                self.buffer[j] = payload
                self._restarts_without_batch = 0
            wait += time.time() - t0
            batch, metrics = self.buffer.pop(b)
            self.batch_index += 1
            if batch is not None and too_stale(learner_version, int(batch.behaviour_versions().min()), self.k):
                self.dropped += 1  # only after the bound was lowered while the batch was in flight
                continue
            break
        self._wait_s = wait
        self.last_metrics = {**metrics, "learner_wait_s": wait, "max_staleness": float(self.k),
                             "batches_dropped_stale": float(self.dropped), "worker_restarts": float(self.restarts)}
        if batch is not None:
            batch.metrics = dict(self.last_metrics)
        return batch

    def on_update(self, learner_metrics: dict[str, float]) -> None:
        self._last_ess = learner_metrics.get("ess")

    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index, "max_staleness": int(self.k)}

    def load_state_dict(self, state: dict) -> None:
        self.batch_index = int(state["batch_index"])
        if self.controller is not None and "max_staleness" in state:
            self.controller.k = int(state["max_staleness"])
            self.k = self.controller.k

    def close(self) -> None:
        try:
            self.transport.close()
        finally:
            closers, self.on_close = self.on_close, []
            try:
                for fn in closers:
                    fn()
            finally:
                if self.model_dir is not None:
                    shutil.rmtree(self.model_dir, ignore_errors=True)


def save_worker_model(spec: WorkerSpec, policy) -> str:
    """Write ``policy`` (architecture, tokenizer, current weights) to a new temporary HF directory and
    point ``spec.model_dir`` at it. Returns the directory; the caller removes it."""
    model_dir = tempfile.mkdtemp(prefix="trustbatch-rollout-model-")
    policy.save(model_dir)
    spec.model_dir = model_dir
    return model_dir


# ---- transport: spawned processes, shared memory ------------------------------------------------------

class _Shared:
    """The state learner and workers share: weights, versions, the capacity gate, the batch counter."""

    def __init__(self, ctx, model: torch.nn.Module, version: int, n_workers: int, k: int):
        self.weights = {name: t.detach().clone().share_memory_() for name, t in named_weights(model)}
        self.version = ctx.Value("q", version, lock=False)
        self.weights_lock = ctx.Lock()
        self.requested = ctx.Value("q", 0, lock=False)  # the batch index the learner asks for now
        self.k = ctx.Value("q", k, lock=False)  # the current staleness bound, in versions
        self.next_index = ctx.Value("q", 0, lock=False)
        self.claim_lock = ctx.Lock()
        self.claimed = ctx.Array("q", [-1] * n_workers, lock=False)
        self.started = ctx.Array("d", [0.0] * n_workers, lock=False)  # when each began its batch; 0: not making one
        self.out = ctx.Queue()
        self.stop = ctx.Event()


def _worker_main(wid: int, spec: WorkerSpec, shared: _Shared, steps_per_round: int, first: int, parent: int) -> None:
    from ..processes import die_with_parent

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and stops us
    try:
        worker = RolloutWorker(spec)
    except BaseException as e:  # report why, then exit: the learner raises it
        shared.out.put(("error", wid, -1, describe_error(e)))
        return
    j = first
    try:
        while not shared.stop.is_set():
            if j < 0:
                with shared.claim_lock:
                    j = shared.next_index.value
                    shared.next_index.value = j + 1
            shared.claimed[wid] = j
            while not (shared.stop.is_set() or may_start(j, shared.requested.value, shared.k.value, steps_per_round)):
                time.sleep(0.002)
            if shared.stop.is_set():
                break
            with shared.weights_lock:
                if shared.version.value != worker.version:
                    worker.load_weights(shared.weights.items(), shared.version.value)
            shared.started[wid] = time.time()
            batch, metrics = worker.make_batch(j)
            # plain pickle copies the tensors into the message: torch's queue pickler would pass them as
            # file descriptors fetched from this process later, lost if it is killed in between
            shared.out.put(("batch", wid, j, pickle.dumps((batch, metrics))))
            shared.started[wid] = 0.0
            j = -1
    except BaseException as e:
        shared.out.put(("error", wid, j, describe_error(e)))
    finally:
        worker.close()


class ProcessTransport:
    """Rollout workers in spawned processes on this machine; weights and gate in shared memory.

    Args:
        spec: what each worker builds (``spec.model_dir`` already written).
        model: the learner's module (its current tensors are the workers' first weights).
        version: the learner's policy version now.
        workers: processes (one torch thread each).
        steps_per_round: optimizer steps per batch, for the capacity rule.

    The bound starts at 0 (nothing runs ahead) until the first ``request`` sets it.
    """

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module, *, version: int, workers: int,
                 steps_per_round: int):
        self.ctx = mp.get_context("spawn")
        self.spec, self.n, self.m = spec, workers, steps_per_round
        self.shared = _Shared(self.ctx, model, version, workers, 0)
        self.procs: list = [None] * workers
        self.first = [-1] * workers  # the batch a restarted worker makes first, until it claims it itself

    def _start(self, wid: int, first: int = -1) -> None:
        p = self.ctx.Process(target=_worker_main, args=(wid, self.spec, self.shared, self.m, first, os.getpid()),
                             daemon=False, name=f"trustbatch-rollout-{wid}")  # it owns a reward pool
        p.start()
        self.procs[wid] = p

    def start(self, first_index: int) -> None:
        self.shared.next_index.value = first_index
        for wid in range(self.n):
            self._start(wid)

    def request(self, b: int, k: int) -> None:
        self.shared.k.value = k
        self.shared.requested.value = b

    def poll(self, timeout_s: float) -> Message | None:
        try:
            kind, wid, j, payload = self.shared.out.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return kind, wid, j, pickle.loads(payload) if kind == "batch" else payload

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
        # the new process claims ``first`` once it has started; until then it holds nothing
        self.shared.claimed[wid] = -1
        self.shared.started[wid] = 0.0
        self.first[wid] = first
        self._start(wid, first)
        return f"exited with code {p.exitcode}"

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Copy the state into shared memory, then publish the version (under the lock workers load under)."""
        with self.shared.weights_lock:
            for name, t in named_weights(model):
                self.shared.weights[name].copy_(t)
            self.shared.version.value = version

    def close(self) -> None:
        self.shared.stop.set()
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

    Raises:
        UserError: from ``next_batch``, when a worker fails for a reason the user must fix (a scorer
            over its failure limit, a model that does not load).
    """

    def __init__(self, spec: WorkerSpec, policy, *, version: int, workers: int = 1, max_staleness: int | str = 0,
                 steps_per_round: int = 1, worker_timeout_s: float = 300.0):
        model_dir = save_worker_model(spec, policy)
        transport = ProcessTransport(spec, policy.model, version=version, workers=workers,
                                     steps_per_round=steps_per_round)
        super().__init__(transport, max_staleness=max_staleness, worker_timeout_s=worker_timeout_s,
                         model_dir=model_dir)
