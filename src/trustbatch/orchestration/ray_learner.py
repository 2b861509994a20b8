"""Learner ranks as Ray actors (``orchestrator=ray``, ``ray_learners=N``): the driver runs the same loop.

``RayLearnerGroup`` is a thin proxy with what the loop and the recipes use from a ``Learner``
(``version``, ``model``, ``train_on``, ``logprobs``, ``state_dict`` / ``load_state_dict``, ``on_step``);
the work runs in N actors, each a plain ``trainer.learner.Learner`` whose ``World`` comes from the rank
environment the driver sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``; gloo on CPU): torchrun's data-parallel learner, with Ray placing the ranks.

- Start: each actor builds the policy from its ``config`` and the driver's named tensors (a module
  never crosses a process, and no shared file system is needed); rank 0 names its node's address and
  a free port for the process group.
- Each round: the batch goes into the object store once and every rank trains on its contiguous
  shard (``Learner.train_on``), with token counts, ESS statistics and gradients all-reduced over the
  ranks (trustbatch.parallel). Rank 0 returns its named tensors as an object of their own: the rollout
  actors fetch that object (``weights_at``, wired into ``RayTransport.weights_from``), and the driver
  copies it into its own module, which evaluation, the log-ratio histogram and checkpoints read.
- Random streams: rank 0 continues the driver's torch stream, so one learner actor reproduces the
  learner in the driver bit for bit; rank r > 0 is seeded with ``seed + r``, as under torchrun.
  ``state_dict`` holds rank 0's optimizer, scheduler and version and every rank's stream.
- Faults: a learner rank that dies or fails ends the run (a ``UserError`` keeps its one line): the
  ranks share collectives, so one cannot be restarted alone; resume from the last checkpoint.
- Shutdown: ``close`` kills the actors and, if the group started Ray, shuts it down and waits for its processes.

CPU only: an actor asks Ray for one CPU and runs one torch thread; GPU ranks (NCCL) are not built.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch

from ..errors import UserError
from ..pipeline.batch import TrainBatch
from ..pipeline.weight_sync import host_weights, named_weights
from .ray_cluster import close_actors, connect, import_ray

NamedTensors = list[tuple[str, torch.Tensor]]


class LearnerRank:
    """One data-parallel rank in a Ray actor: a ``Learner`` over a ``World`` from the environment ``setup`` sets."""

    def __init__(self, threads: int = 1):
        torch.set_num_threads(threads)
        self.learner = None
        self.steps: list[tuple[int, NamedTensors]] = []

    def node(self) -> tuple[str, str]:
        """(this node's IP address, its Ray node id): the driver derives MASTER_ADDR and LOCAL_RANK."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        """A TCP port free on this node now, for rank 0's process-group store."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, env: dict[str, str], config, weights: NamedTensors, rng_state: torch.Tensor,
              objective: str, options: dict, learner_kwargs: dict) -> None:
        """Join the process group that ``env`` describes and build the rank's policy and ``Learner``."""
        from transformers import AutoModelForCausalLM

        from ..trainer.learner import Learner
        from ..parallel import World

        os.environ.update(env)
        state = dict(weights)
        model = AutoModelForCausalLM.from_config(config)
        dtype = next(t.dtype for t in state.values() if t.is_floating_point())
        model.to(dtype)  # before loading: a float64 policy must not pass through float32 parameters
        model.load_state_dict(state)
        torch.set_rng_state(rng_state)
        self.learner = Learner(model, objective, options, world=World.from_env(), **learner_kwargs)

    def record_steps(self) -> None:
        """Keep the named tensors after every optimizer step, for the driver's ``on_step`` hooks."""
        self.learner.on_step.append(lambda v, m: self.steps.append((v, [(n, t.clone()) for n, t in named_weights(m)])))

    def train_on(self, batch: TrainBatch, with_weights: bool):
        """``((metrics, version, per-step weights, per-step records), named tensors or None)``: Ray returns them
        as two objects. The per-step records are the ``Learner.step_records`` of this rank, whose metrics already
        cover every rank."""
        self.steps = []
        metrics = self.learner.train_on(batch)
        weights = list(host_weights(self.learner.model)) if with_weights else None
        return (metrics, self.learner.version, self.steps, self.learner.step_records), weights

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.learner.logprobs(batch)

    def state(self) -> tuple[dict, torch.Tensor]:
        return self.learner.state_dict(), torch.get_rng_state()

    def load_state(self, state: dict, rng_state: torch.Tensor | None) -> None:
        self.learner.load_state_dict(state)
        if rng_state is not None:
            torch.set_rng_state(rng_state)

    def execute(self, fn: Callable, *args):
        """``fn(learner, *args)`` on this rank (inspection and tests)."""
        return fn(self.learner, *args)


class RayLearnerGroup:
    """N learner ranks as Ray actors behind the ``Learner`` interface the loop uses (module docstring).

    Args:
        model: the driver's policy module: the ranks start from its weights, and it is kept equal to
            rank 0's after every ``train_on`` (updated in place, so engines sharing it see the update).
        objective, options: as ``Learner``'s (validated there; ``recipes.build.preflight`` checks them first).
        ranks: learner actors (one CPU and one torch thread each).
        seed: rank r > 0 seeds its torch stream with ``seed + r``.
        version: the policy version to start from.
        address: the Ray cluster to join (``ray_cluster.connect``).
        rollout_workers: CPUs the run's rollout actors take beside the ranks (the cluster check, and
            the size of a local cluster started here).
        learner_kwargs: ``Learner``'s other keywords (lr, micro_batch_size, epochs, ...); not ``world``.

    Raises:
        UserError: Ray is not installed; the cluster has too few CPUs; a rank fails while building
            its learner for a reason the user must fix.
        RuntimeError: a rank fails otherwise (its traceback).
    """

    def __init__(self, model: torch.nn.Module, objective: str, options: dict | None = None, *, ranks: int = 1,
                 seed: int = 0, version: int = 0, address: str | None = None, rollout_workers: int = 0,
                 **learner_kwargs):
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ray = ray = import_ray()
        self.model, self.version, self.n = model, version, ranks
        self.on_step: list[Callable[[int, torch.nn.Module], None]] = []
        # the ranks' per-step log-ratios stay in their actors: no hook (``Learner.on_step_ratios``)
        self.on_step_ratios = None
        self.sharded = False  # each rank holds the whole module (DDP)
        self.step_records: list[dict[str, float]] = []  # rank 0's, as ``Learner.step_records``
        self.actors: list = []
        self._weights: tuple[int, object] | None = None  # (version, rank 0's named tensors in the object store)
        self._recording = False
        self.started_ray = connect(address, cpus=ranks + rollout_workers)
        try:
            cpus = ray.cluster_resources().get("CPU", 0.0)
            if cpus < ranks + rollout_workers:  # an actor that cannot be placed waits forever
                raise UserError(f"the Ray cluster has {cpus:g} CPUs but ray_learners={ranks} and "
                                f"rollout.workers={rollout_workers} actors need one each; lower them or add nodes")
            remote = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(LearnerRank)
            self.actors = [remote.remote(1) for _ in range(ranks)]
            nodes = self._get([a.node.remote() for a in self.actors])
            port = self._get([self.actors[0].free_port.remote()])[0]
            weights = ray.put(list(host_weights(model)))
            calls = []
            for r, actor in enumerate(self.actors):
                env = {"MASTER_ADDR": nodes[0][0], "MASTER_PORT": str(port), "RANK": str(r),
                       "WORLD_SIZE": str(ranks), "LOCAL_RANK": str([n[1] for n in nodes[:r]].count(nodes[r][1]))}
                rng = torch.get_rng_state() if r == 0 else torch.Generator().manual_seed(seed + r).get_state()
                calls.append(actor.setup.remote(env, model.config, weights, rng, objective, dict(options or {}),
                                                {**learner_kwargs, "version": version}))
            self._get(calls)  # together: init_process_group waits for every rank
        except BaseException:
            self.close()
            raise

    def _get(self, refs: list) -> list:
        """Every result in order; the first failure is raised at once (the other ranks may be stuck in a collective)."""
        ray = self.ray
        pending, done = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                done[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, UserError):
                    raise cause from None
                raise RuntimeError(f"a learner rank failed:\n{e}") from None
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed:
                    raise RuntimeError(f"a learner rank could not start:\n{e}") from None
                raise RuntimeError(f"a learner rank died ({str(e).splitlines()[0]}); the ranks share collectives, "
                                   "so the run stops: resume it from its last checkpoint") from None
        return [done[r] for r in refs]

    def _load(self, weights: NamedTensors) -> None:
        with torch.no_grad():
            state = self.model.state_dict()  # tensors that share the parameters' storage
            for name, t in weights:
                state[name].copy_(t)

    # ---- what the loop and the recipes use ---------------------------------------------------------
    def train_on(self, batch: TrainBatch) -> dict[str, float]:
        """``epochs × minibatches`` optimizer steps on ``batch`` over the ranks (each on its shard);
        rank 0's metrics, which cover every rank. Afterwards ``model`` holds the new weights."""
        if self.on_step and not self._recording:
            self._get([self.actors[0].record_steps.remote()])
            self._recording = True
        ref = self.ray.put(batch)
        calls = [a.train_on.options(num_returns=2).remote(ref, r == 0) for r, a in enumerate(self.actors)]
        results = self._get([c[0] for c in calls])
        metrics, version, steps, self.step_records = results[0]
        for v, w in steps:  # hooks see the weights of every optimizer step, in order
            self._load(w)
            for fn in self.on_step:
                fn(v, self.model)
        self._load(self._get([calls[0][1]])[0])
        self.version = version
        self._weights = (version, calls[0][1])
        return metrics

    def weights_at(self, version: int):
        """Rank 0's named tensors at ``version`` as an object in Ray's store, or None if it holds another version."""
        if self._weights is not None and self._weights[0] == version:
            return self._weights[1]
        return None

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, C]`` of the batch's completions under the current policy (rank 0, no gradient)."""
        return self._get([self.actors[0].logprobs.remote(batch)])[0]

    def state_dict(self) -> dict:
        """Rank 0's learner state (optimizer, scheduler, policy version) and every rank's torch stream (``rank_rng``)."""
        states = self._get([a.state.remote() for a in self.actors])
        return {**states[0][0], "rank_rng": [rng for _, rng in states]}

    def load_state_dict(self, state: dict) -> None:
        rngs = state.get("rank_rng")
        rngs = rngs if rngs is not None and len(rngs) == self.n else [None] * self.n
        learner_state = {k: v for k, v in state.items() if k != "rank_rng"}
        self._get([a.load_state.remote(learner_state, rng) for a, rng in zip(self.actors, rngs)])
        self.version = int(state["policy_version"])
        self._weights = None

    def execute(self, fn: Callable, *args) -> list:
        """``fn(learner, *args)`` on every rank (a function Ray can pickle); the results in rank order."""
        return self._get([a.execute.remote(fn, *args) for a in self.actors])

    def close(self) -> None:
        """Kill the ranks, and shut Ray down if this group started it (``ray_cluster.close_actors``: its processes
        have ended when this returns); safe to call twice."""
        close_actors(self.ray, self.actors, self.started_ray)
        self.actors = []
        self._weights = None
        self.started_ray = False
