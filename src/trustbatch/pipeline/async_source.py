"""The rules of asynchronous rollout: workers run ahead of the learner by at most k policy versions.

Same protocol as ``SyncSource``, so the loop cannot tell them apart. Each worker (one torch thread)
holds a ``RolloutWorker`` (engine, reward pool, batch maker) and makes whole batches: batch ``b``'s
prompts and random streams depend only on (seed, b), so a worker makes exactly the batch the sync
source would. With ``max_staleness=0`` the pipeline runs in lockstep and reproduces the sync source bit for
bit (same threads); with k > 0 a worker starts batch ``b`` as soon as the capacity rule of
``pipeline.staleness`` allows, while the learner trains on earlier ones.

Which weights sample batch ``b`` (``rollout.async_order``):

- ``deterministic`` (the default): those of round ``b − floor(k / steps per round)``
  (``staleness.behaviour_round``), whichever worker makes it and whenever; the transport keeps the weights
  of the last ``ahead + 1`` rounds (``ahead = rounds_ahead(k, m)``), and a checkpoint holds the ``ahead``
  older rounds' weights, so that a run, resumed or not, is a function of its configuration and seed.
- ``latest``: the newest weights when the worker starts the batch; fresher on average, but which version a
  batch gets depends on worker timing, and a resume samples the first batches with newer weights.
  ``max_staleness=auto`` always runs so: its bound itself follows the learner's wait time.

The rules exist once, here, whatever carries the batches:

- ``BoundedSource``: batch order, the capacity bound k (fixed or ``StalenessController``), the drop
  rule, restarts of dead or hung workers, learner wait time and the round's metrics, checkpoint state.
- a ``Transport``: where the workers run and how weights and batches travel, one module each in
  ``orchestration``: ``process_rollout.ProcessTransport`` (spawned processes, weights in shared memory;
  ``AsyncSource``) and ``ray_rollout.RayTransport`` (Ray actors, weights through Ray's object store).

Faults: a worker that dies, or has been making the batch the learner waits for longer than
``worker_timeout_s``, is killed and restarted on the batch it held (counted in ``worker_restarts``).
The time counts from when the worker began the batch, so a restarted worker's start-up (seconds: torch,
the model) is never taken for a hang.
"""

from __future__ import annotations

import shutil
import time
import traceback
import warnings
from typing import Protocol

import torch

from ..errors import UserError
from .batch import TrainBatch
from .staleness import StalenessController, rounds_ahead, too_stale


_MAX_RESTARTS_WITHOUT_BATCH = 3  # per worker: beyond this a worker cannot start at all (a crash loop)
_POLL_S = 0.2  # how long the learner waits for a message before it checks the workers' health

# A transport's message: ("batch", wid, j, (batch, metrics)) or ("error", wid, j, (is_user_error, text)).
Message = tuple[str, int, int, tuple]


class Transport(Protocol):
    """Where rollout workers run and how weights and batches travel; ``BoundedSource`` holds the rules.

    Worker ids are ``0 … n − 1``; batch indices count from 0 over the whole run.
    """

    n: int
    ahead: int | None
    """Deterministic order: batch ``j`` is sampled by round ``behaviour_round(j, ahead, floor)``'s weights;
    None: by the newest weights (``latest``)."""

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
        """Weight sync: make ``model``'s named tensors, policy ``version``, the workers' next weights
        (the weights of round ``b + 1`` after the last ``request(b)``)."""
        ...

    def snapshots(self, rounds: range) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
        """The weights the transport holds for ``rounds``: {round: (policy version, {name: tensor})} (CPU copies)."""
        ...

    def preload(self, snapshots: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Before ``start``: the weights of rounds before the first (a resume's checkpoint holds them)."""
        ...

    def close(self) -> None:
        """Stop every worker and release what the transport holds; safe to call twice."""
        ...


def order_ahead(order: str, max_staleness: int | str, steps_per_round: int) -> int | None:
    """The transports' ``ahead`` for ``rollout.async_order``: ``rounds_ahead(k, m)`` when deterministic with a
    fixed k, None for ``latest`` or ``max_staleness="auto"`` (a bound that follows timing cannot fix the order)."""
    if order == "latest" or max_staleness == "auto":
        return None
    if order != "deterministic":
        raise ValueError(f"async order must be 'deterministic' or 'latest', got {order!r}")
    return rounds_ahead(int(max_staleness), steps_per_round)


def describe_error(e: BaseException) -> tuple[bool, str]:
    """(is a UserError, message): a scorer limit keeps its one line; anything else carries its traceback."""
    if isinstance(e, UserError):
        return True, str(e)
    return False, "".join(traceback.format_exception(e)).strip()


class BoundedSource:
    """Rollout workers that run ahead of the learner by at most ``max_staleness`` policy versions.

    The rules (module docstring) over a ``Transport``; ``orchestration.process_rollout.AsyncSource`` and
    ``orchestration.ray_rollout.ray_source`` build one.

    Args:
        transport: the workers (constructed, not yet started; ``start`` runs on the first ``next_batch``).
        max_staleness: k in policy versions, or "auto" (``StalenessController``, starting at 1).
        worker_timeout_s: a worker that has been making the awaited batch this long is restarted.
        model_dir: the workers' model directory (``rollout_worker.save_worker_model``), removed by ``close``.

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
        self._resumed_round_s: float | None = None  # the checkpointed round's length, for its pending update
        # run by ``close`` after the transport's: parts that share its workers' lifetime (Ray learner ranks)
        self.on_close: list = []
        # ``weight_sync.BehaviourVersions`` (the exact KL): names each batch's behaviour model; None: batches carry none
        self.behaviour = None

    # ---- worker health ----------------------------------------------------------------------------
    def _restart(self, wid: int) -> None:
        held = self.transport.held(wid)
        self.restarts += 1
        self._restarts_without_batch += 1
        # a batch already trained on (its worker died just after sending it) or already made is not made again
        ended = self.transport.restart(wid, held if held >= self.batch_index and held not in self.buffer else -1)
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
        round_s = now - self._round_t0 if self._round_t0 is not None else self._resumed_round_s
        if self.controller is not None and round_s is not None:
            self.k = self.controller.update(self._last_ess, self._wait_s, round_s)
        # each ESS moves k once: a round the loop skips (no batch, no on_update) measured none
        self._last_ess, self._resumed_round_s = None, None
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
                if j >= self.batch_index:  # a second copy of a batch trained on (a restart's) is dropped
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
            if self.behaviour is not None:
                self.behaviour.attach(batch)
        return batch

    def on_update(self, learner_metrics: dict[str, float]) -> None:
        self._last_ess = learner_metrics.get("ess")

    def _older_rounds(self) -> range:
        """The rounds before the next batch whose weights sample upcoming batches (deterministic order)."""
        ahead = self.transport.ahead
        return range(max(0, self.batch_index - (ahead or 0)), self.batch_index)

    def state_dict(self) -> dict:
        """The next batch, the bound, the counts of dropped batches and worker restarts, with ``max_staleness=auto``
        the controller's pending update (the last round's ESS, wait and length so far), and in deterministic order
        the weights of the ``ahead`` rounds before the next batch (``ahead`` copies of the policy's state: the price
        of a bit-identical resume)."""
        state = {"batch_index": self.batch_index, "max_staleness": int(self.k),
                 "dropped": self.dropped, "restarts": self.restarts}  # the run's counts, not the segment's
        if self.controller is not None and self._round_t0 is not None:
            state["pending"] = {"ess": self._last_ess, "wait_s": self._wait_s, "round_s": time.time() - self._round_t0}
        if self.transport.ahead is not None:
            state["snapshots"] = self.transport.snapshots(self._older_rounds())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.batch_index = int(state["batch_index"])
        self.dropped, self.restarts = int(state.get("dropped", 0)), int(state.get("restarts", 0))
        if self.controller is not None and "max_staleness" in state:
            self.controller.k = int(state["max_staleness"])
            self.k = self.controller.k
            pending = state.get("pending")
            if pending:  # the update the uninterrupted run makes before its next batch
                self._last_ess, self._wait_s, self._resumed_round_s = pending["ess"], pending["wait_s"], pending["round_s"]
        if self.transport.ahead is not None:
            snapshots = state.get("snapshots", {})
            missing = [r for r in self._older_rounds() if r not in snapshots]
            if missing:
                warnings.warn(f"the checkpoint holds no weights of rounds {missing[0]}-{missing[-1]}, which sample the "
                              "next batches in rollout.async_order=deterministic (it was written in latest order, or "
                              "with a smaller max_staleness): those batches are sampled by the checkpoint's policy, "
                              "so this resume differs from an uninterrupted run", stacklevel=2)
            self.transport.preload(snapshots)
            if self.behaviour is not None:  # the versions that sample the next batches, for their behaviour models
                for version, weights in snapshots.values():
                    self.behaviour.keep(version, weights)

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
