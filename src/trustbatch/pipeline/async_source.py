"""The asynchronous rollout source: rollout workers in their own processes run ahead of the learner by at most k versions.

Same protocol as ``SyncSource``, so the loop cannot tell them apart. Each worker (one torch thread)
holds a ``RolloutWorker`` (engine, reward pool, batch maker) and makes whole batches: batch ``b``'s
prompts and random streams depend only on (seed, b), so a worker makes exactly the batch the sync
source would, with the newest weights it has. With ``max_staleness=0`` the pipeline runs in lockstep
and reproduces the sync source bit for bit (same threads); with k > 0 a worker starts batch ``b`` as soon
as the capacity rule of ``pipeline.staleness`` allows, while the learner trains on earlier ones.

Weights reach the workers through shared memory: after each round the learner copies its state into
one shared-memory copy of the named tensors and bumps a shared version (``SharedMemorySync.push``);
a worker loads them with its engine's ``load_weights`` before each batch when the version moved.

Faults: a worker that dies, or holds the batch the learner waits for longer than ``worker_timeout_s``,
is killed and restarted on the same batch (counted in ``worker_restarts``). Workers ignore Ctrl-C,
die with the trainer (``processes.die_with_parent``), and ``close`` stops and reaps them.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from ..errors import UserError
from ..orchestration.rollout_worker import RolloutWorker, WorkerSpec
from .batch import TrainBatch
from .staleness import StalenessController, may_start, too_stale
from .weight_sync import named_weights


_MAX_RESTARTS_WITHOUT_BATCH = 3  # per worker: beyond this a worker cannot start at all (a crash loop)


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
        self.out = ctx.Queue()
        self.stop = ctx.Event()


def _worker_main(wid: int, spec: WorkerSpec, shared: _Shared, steps_per_round: int, first: int, parent: int) -> None:
    from ..processes import die_with_parent

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and stops us
    try:
        worker = RolloutWorker(spec)
    except BaseException as e:  # report why, then exit: the learner raises it
        shared.out.put(("error", wid, -1, _describe(e)))
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
            batch, metrics = worker.make_batch(j)
            shared.out.put(("batch", wid, j, (batch, metrics)))
            j = -1
    except BaseException as e:
        shared.out.put(("error", wid, j, _describe(e)))
    finally:
        worker.close()


def _describe(e: BaseException) -> tuple[bool, str]:
    """(is a UserError, message): a scorer limit keeps its one line; anything else carries its traceback."""
    if isinstance(e, UserError):
        return True, str(e)
    return False, "".join(traceback.format_exception(e)).strip()


class SharedMemorySync:
    """Weight sync to the async workers: copy the state into shared memory, then publish the version."""

    def __init__(self, shared: _Shared):
        self.shared = shared

    def push(self, model: torch.nn.Module, version: int) -> None:
        with self.shared.weights_lock:
            for name, t in named_weights(model):
                self.shared.weights[name].copy_(t)
            self.shared.version.value = version


class AsyncSource:
    """Rollout workers that run ahead of the learner by at most ``max_staleness`` policy versions.

    Args:
        spec: what each worker builds (the policy is written to a temporary HF directory for it).
        policy: the learner's policy (its current weights are the workers' first weights).
        version: the learner's policy version now.
        workers: rollout processes (one torch thread each).
        max_staleness: k in policy versions, or "auto" (``StalenessController``, starting at 1).
        steps_per_round: optimizer steps the learner takes per batch (epochs × minibatches).
        worker_timeout_s: a worker that holds the awaited batch this long is restarted.

    Raises:
        UserError: from ``next_batch``, when a worker fails for a reason the user must fix (a scorer
            over its failure limit, a model that does not load).
    """

    def __init__(self, spec: WorkerSpec, policy, *, version: int, workers: int = 1, max_staleness: int | str = 0,
                 steps_per_round: int = 1, worker_timeout_s: float = 300.0):
        self.ctx = mp.get_context("spawn")
        self.controller = StalenessController() if max_staleness == "auto" else None
        k = self.controller.k if self.controller else int(max_staleness)
        self.model_dir = tempfile.mkdtemp(prefix="trustbatch-rollout-model-")
        policy.save(self.model_dir)
        spec.model_dir = self.model_dir
        self.spec, self.n, self.m = spec, workers, steps_per_round
        self.timeout = worker_timeout_s
        self.shared = _Shared(self.ctx, policy.model, version, workers, k)
        self.sync = SharedMemorySync(self.shared)
        self.procs: list = [None] * workers
        self.batch_index = 0
        self.buffer: dict[int, tuple] = {}
        self.restarts = 0
        self._restarts_without_batch = 0
        self.dropped = 0
        self.last_metrics: dict[str, float] = {}
        self._wait_s = 0.0
        self._round_t0: float | None = None

    # ---- processes -----------------------------------------------------------------------------
    def _start(self, wid: int, first: int = -1) -> None:
        p = self.ctx.Process(target=_worker_main, args=(wid, self.spec, self.shared, self.m, first, os.getpid()),
                             daemon=False, name=f"trustbatch-rollout-{wid}")  # it owns a reward pool
        p.start()
        self.procs[wid] = p

    def _restart(self, wid: int) -> None:
        held = self.shared.claimed[wid]
        p = self.procs[wid]
        if p.is_alive():
            p.kill()
        p.join(5)
        self.restarts += 1
        self._restarts_without_batch += 1
        if self._restarts_without_batch > _MAX_RESTARTS_WITHOUT_BATCH * self.n:
            raise RuntimeError(f"rollout workers keep dying before making a batch (worker {wid} exited with code "
                               f"{p.exitcode}); their stderr above says why")
        self._start(wid, first=held if held >= 0 and held not in self.buffer else -1)

    def _check_workers(self, waiting_for: int, since: float) -> bool:
        """Restart dead workers, and the one hung on the awaited batch. True if any was restarted."""
        restarted = False
        for wid, p in enumerate(self.procs):
            hung = self.shared.claimed[wid] == waiting_for and time.time() - since > self.timeout
            if hung or not p.is_alive():
                self._restart(wid)
                restarted = True
        return restarted

    # ---- the protocol --------------------------------------------------------------------------
    def next_batch(self, learner_version: int) -> TrainBatch | None:
        if self.procs[0] is None:
            self.shared.next_index.value = self.batch_index
            for wid in range(self.n):
                self._start(wid)
        now = time.time()
        round_s = now - self._round_t0 if self._round_t0 is not None else 0.0
        if self.controller is not None and self._round_t0 is not None:
            self.shared.k.value = self.controller.update(self._last_ess, self._wait_s, round_s)
        self._round_t0 = now
        wait = 0.0
        while True:
            b = self.batch_index
            self.shared.requested.value = b
            t0 = time.time()
            while b not in self.buffer:
                try:
                    kind, wid, j, payload = self.shared.out.get(timeout=0.2)
                except queue.Empty:
                    if self._check_workers(b, t0):
                        t0 = time.time()  # the restarted worker gets the full timeout again
                    continue
                if kind == "error":
                    is_user, msg = payload
                    raise UserError(msg) if is_user else RuntimeError(f"rollout worker {wid} failed:\n{msg}")
                self.buffer[j] = payload
                self._restarts_without_batch = 0
            wait += time.time() - t0
            batch, metrics = self.buffer.pop(b)
            self.batch_index += 1
            if batch is not None and too_stale(learner_version, int(batch.behaviour_versions().min()),
                                               self.shared.k.value):
                self.dropped += 1  # only after the bound was lowered while the batch was in flight
                continue
            break
        self._wait_s = wait
        self.last_metrics = {**metrics, "learner_wait_s": wait, "max_staleness": float(self.shared.k.value),
                             "batches_dropped_stale": float(self.dropped), "worker_restarts": float(self.restarts)}
        if batch is not None:
            batch.metrics = dict(self.last_metrics)
        return batch

    _last_ess: float | None = None

    def on_update(self, learner_metrics: dict[str, float]) -> None:
        self._last_ess = learner_metrics.get("ess")

    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index, "max_staleness": int(self.shared.k.value)}

    def load_state_dict(self, state: dict) -> None:
        self.batch_index = int(state["batch_index"])
        if self.controller is not None and "max_staleness" in state:
            self.controller.k = int(state["max_staleness"])
            self.shared.k.value = self.controller.k

    def close(self) -> None:
        self.shared.stop.set()
        for p in self.procs:
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        shutil.rmtree(self.model_dir, ignore_errors=True)
