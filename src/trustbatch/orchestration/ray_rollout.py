"""Rollout workers as Ray actors: the transport of ``BoundedSource`` for one machine or a cluster.

``orchestrator=ray rollout.mode=async``: the driver (the trainer's process) runs the same loop; the
learner runs as Ray actors too (``orchestration.ray_learner``, ``ray_learners`` ranks) or, with
``ray_learners=0``, in the driver. Each rollout worker is the plain ``RolloutWorker`` class wrapped with ``ray.remote`` (one CPU
each). The rules (batch order, capacity bound, drop rule, restarts, metrics) are ``BoundedSource``'s,
as for spawned processes; only the transport differs:

- Weights: ``push`` puts the learner's named tensors into Ray's object store once per version
  (``ray.put``), or takes the object learner rank 0 already returned for that version
  (``weights_from``); ``request(b)`` records the newest object as round ``b``'s. An actor that holds
  another version than its batch's (the newest, or round ``behaviour_round(j, ahead, floor)``'s in
  deterministic order) gets a ``load_weights`` call with that reference before the batch, so it fetches
  the tensors from the object store itself (from another node if it runs there), and only when it needs them.
- Batches: the driver hands batch ``j`` to an idle actor when the capacity rule allows it
  (``may_start``), one batch per actor at a time; results come back through the object store.
  Unlike a spawned process, which claims its next batch by itself, an actor that finishes while the
  learner trains waits for the driver's next call to the source (``next_batch``): at most one batch
  per actor runs ahead of that call. With ``rollout.workers ≥ floor(k / steps per round) + 1`` that
  costs nothing.
- Faults: an actor whose call fails with ``RayActorError`` is dead; ``BoundedSource`` restarts it (a
  new actor) on the batch it held and counts it. A hung one is killed with ``ray.kill``.
- Shutdown: ``close`` kills the actors and, if this transport started Ray, shuts the local cluster down and
  waits for its processes (``ray_cluster``: ``ray.init()`` with no address and no ``RAY_ADDRESS`` starts a
  local cluster; an address joins one, after a bounded check that it answers).
"""

from __future__ import annotations

import shutil
import time

from typing import Callable

import torch

from ..errors import UserError
from ..pipeline.async_source import BoundedSource, Message, describe_error, order_ahead
from ..pipeline.staleness import behaviour_round, may_start
from ..pipeline.weight_sync import Stateless, host_weights
from .ray_cluster import close_actors, connect, import_ray
from .rollout_worker import RolloutWorker, WorkerSpec, for_start, save_worker_model


class RayTransport(Stateless):
    """Rollout workers as Ray actors (``RolloutWorker`` with ``ray.remote``, ``num_cpus=1``); see the module docstring.

    Args:
        spec: what each actor builds (``spec.model_dir`` already written; on a multi-node cluster it
            must be a path every node can read, e.g. a shared file system).
        model: the learner's module (its current tensors are the actors' first weights).
        version: the learner's policy version now.
        workers: actors, one CPU each.
        steps_per_round: optimizer steps per batch, for the capacity rule.
        address: the Ray cluster to join (``ray.init(address=...)``); None: ``RAY_ADDRESS``, a cluster
            started on this machine with ``ray start``, or else a new local one. Ignored when Ray is
            already initialised in this process.
        ahead: deterministic order (``async_source.order_ahead``): the object store keeps the last
            ``ahead + 1`` rounds' weights; None: the newest only.

    Raises:
        UserError: Ray is not installed; the cluster has fewer CPUs than ``workers``.
    """

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module, *, version: int, workers: int,
                 steps_per_round: int, address: str | None = None, ahead: int | None = None):
        ray = import_ray()
        self.ray = ray
        self.spec, self.n, self.m, self.ahead = spec, workers, steps_per_round, ahead
        self.rounds: dict[int, tuple[int, object]] = {}  # round -> (version, weights object), deterministic order
        self.floor = 0
        self._preloaded: dict = {}
        # version -> the learner's own object of named tensors for it, or None (then ``push`` puts them)
        self.weights_from: Callable[[int], object] | None = None
        self.started_ray = connect(address, cpus=workers)
        self.actors: list = [None] * workers
        try:
            cpus = ray.cluster_resources().get("CPU", 0.0)
            if cpus < workers:  # an actor that cannot be placed waits forever
                raise UserError(f"the Ray cluster has {cpus:g} CPUs but rollout.workers={workers} actors need one "
                                "each; lower rollout.workers or add nodes")
            self._remote = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(RolloutWorker)
            self.requested, self.k = 0, 0  # until the first request
            self.starts = 0  # actors started so far, restarts included (``for_start``)
            self.next_index = 0
            self.held_batch = [-1] * workers  # the batch each actor makes (or will make first after a restart)
            self.calls: list = [None] * workers  # (make_batch ref, load_weights ref or None) in flight
            self.actor_version: list = [None] * workers  # None: a new actor, which loads before its first batch
            self.dead = [False] * workers
            self.ready: list = [None] * workers  # each actor's construction, then the time it was seen done
            self.submitted = [0.0] * workers
            self.version = version
            self.weights_ref = ray.put(list(host_weights(model)))
        except BaseException:
            self.close()
            raise

    # ---- actors ------------------------------------------------------------------------------------
    def _new_actor(self, wid: int) -> None:
        self.actors[wid] = self._remote.remote(for_start(self.spec, self.starts))
        self.starts += 1
        self.ready[wid] = self.actors[wid].__ray_ready__.remote()
        self.actor_version[wid] = None
        self.calls[wid] = None
        self.dead[wid] = False

    def _weights_for(self, j: int) -> tuple[int, object]:
        """(version, weights object) that samples batch ``j``."""
        if self.ahead is None:
            return self.version, self.weights_ref
        want = behaviour_round(j, self.ahead, self.floor)
        # a round already let go samples only batches already trained on (a restarted actor's duplicate)
        return self.rounds.get(want) or self.rounds[min(self.rounds)]

    def _submit(self, wid: int, j: int) -> None:
        actor = self.actors[wid]
        load = None
        version, ref = self._weights_for(j)
        if self.actor_version[wid] != version:
            # the reference is resolved in the actor: it fetches the tensors from the object store
            load = actor.load_weights.remote(ref, version)
            self.actor_version[wid] = version
        self.calls[wid] = (actor.make_batch.remote(j), load)  # an actor runs its calls in order
        self.held_batch[wid] = j
        self.submitted[wid] = time.time()

    def _dispatch(self) -> None:
        """Give each idle live actor its held batch, or else the next batch the capacity rule allows."""
        for wid in range(self.n):
            if self.calls[wid] is not None or self.dead[wid]:
                continue
            j = self.held_batch[wid]
            if j < 0:
                if not may_start(self.next_index, self.requested, self.k, self.m):
                    continue  # another actor may still hold a batch handed over on a restart
                j = self.next_index
                self.next_index += 1
            self._submit(wid, j)

    # ---- the Transport protocol --------------------------------------------------------------------
    def start(self, first_index: int) -> None:
        self.next_index = self.floor = first_index
        while self.ahead is not None and first_index - self.floor < self.ahead and self.floor - 1 in self._preloaded:
            version, state = self._preloaded[self.floor - 1]
            self.floor -= 1
            self.rounds[self.floor] = (version, self.ray.put(list(state.items())))
        for wid in range(self.n):
            self._new_actor(wid)

    def request(self, b: int, k: int) -> None:
        self.requested, self.k = b, k
        if self.ahead is not None:
            self.rounds.setdefault(b, (self.version, self.weights_ref))
            for r in [r for r in self.rounds if r < b - self.ahead]:  # they sample no batch still to make
                del self.rounds[r]
        self._dispatch()

    def poll(self, timeout_s: float) -> Message | None:
        ray = self.ray
        self._dispatch()
        pending = {c[0]: wid for wid, c in enumerate(self.calls) if c is not None}
        if not pending:
            time.sleep(timeout_s)
            return None
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
        if not ready:
            return None
        wid = pending[ready[0]]
        batch_ref, load_ref = self.calls[wid]
        self.calls[wid] = None
        j = self.held_batch[wid]
        try:
            if load_ref is not None:
                ray.get(load_ref)
            result = ray.get(batch_ref)
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:  # the actor cannot even build its worker: a restart would not help
                return "error", wid, j, (False, str(e))
            self.dead[wid] = True  # BoundedSource restarts it on held_batch[wid]
            return None
        except ray.exceptions.RayTaskError as e:
            return "error", wid, j, describe_error(e.cause if isinstance(e.cause, BaseException) else e)
        self.held_batch[wid] = -1
        self._dispatch()  # the idle actor takes the next allowed batch before the learner trains
        return "batch", wid, j, result

    def held(self, wid: int) -> int:
        return self.held_batch[wid]

    def alive(self, wid: int) -> bool:
        return not self.dead[wid]

    def busy_since(self, wid: int) -> float | None:
        """When the actor's batch call was handed over, or when the actor was seen constructed if later."""
        if self.calls[wid] is None or self.dead[wid]:
            return None
        if not isinstance(self.ready[wid], float):
            done, _ = self.ray.wait([self.ready[wid]], timeout=0)
            if not done:
                return None  # still starting up: not hung
            self.ready[wid] = time.time()
        return max(self.submitted[wid], self.ready[wid])

    def restart(self, wid: int, first: int) -> str:
        how = "died" if self.dead[wid] else "was killed after holding the awaited batch too long"
        try:
            self.ray.kill(self.actors[wid], no_restart=True)
        except Exception:  # already gone
            pass
        self._new_actor(wid)
        self.held_batch[wid] = first
        self._dispatch()
        return how

    def push(self, model: torch.nn.Module, version: int) -> None:
        """Put the named tensors in the object store once (or take the learner's object for ``version``,
        ``weights_from``); actors behind ``version`` fetch them before their next batch."""
        ref = self.weights_from(version) if self.weights_from is not None else None
        # the old reference is freed when unused
        self.weights_ref = ref if ref is not None else self.ray.put(list(host_weights(model)))
        self.version = version

    def snapshots(self, rounds: range) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
        return {r: (self.rounds[r][0], {n: t.clone() for n, t in self.ray.get(self.rounds[r][1])})
                for r in rounds if r in self.rounds}

    def preload(self, snapshots: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
        self._preloaded = dict(snapshots)

    def close(self) -> None:
        close_actors(self.ray, self.actors, self.started_ray)
        self.actors = [None] * self.n
        self.calls = [None] * self.n
        self.weights_ref = None
        self.rounds = {}
        self.started_ray = False


def ray_source(spec: WorkerSpec, policy, *, version: int, workers: int = 1, max_staleness: int | str = 0,
               steps_per_round: int = 1, worker_timeout_s: float = 300.0, address: str | None = None,
               async_order: str = "deterministic") -> BoundedSource:
    """The asynchronous rollout source with Ray actors as workers (arguments as ``process_rollout.AsyncSource``'s,
    plus ``address``, see ``RayTransport``).

    Raises:
        UserError: Ray is not installed; the cluster has too few CPUs.
    """
    model_dir = save_worker_model(spec, policy)
    try:
        transport = RayTransport(spec, policy.model, version=version, workers=workers,
                                 steps_per_round=steps_per_round, address=address,
                                 ahead=order_ahead(async_order, max_staleness, steps_per_round))
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    return BoundedSource(transport, max_staleness=max_staleness, worker_timeout_s=worker_timeout_s,
                         model_dir=model_dir)
