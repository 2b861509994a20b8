"""The learner and rollout source each ``(rollout.mode, orchestrator)`` pair builds, registered by that pair.

``recipes.build.build_parts`` looks a ``Backend`` up (``backend_for``) instead of branching on the names: its
``check`` refuses what the pair cannot run, before any work; ``learner`` builds the learner; ``source`` the
rollout source with its weight sync. A new backend is one more entry in ``BACKENDS``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import objectives
from ..config import Config
from ..errors import UserError
from ..orchestration.process_rollout import AsyncSource
from ..orchestration.rollout_worker import WorkerSpec
from ..parallel import World
from ..pipeline.async_source import BoundedSource
from ..pipeline.source import RolloutSource, SourceSpec, SyncSource
from ..pipeline.weight_sync import BehaviourVersions, CopySync, LaggedSync, SharedSync, WeightSync
from ..policy.lora import merged_copy
from ..policy.reward_model import load_reward_model
from ..rewards.spec import RewardSpec
from ..rollout.engine import Engine
from ..rollout.spec import EngineSpec, behaviour_distribution, make_engine, shares_module
from ..trainer.learner import Learner
from ..trainer.loop import LearnerProtocol


@dataclass
class Inputs:
    """What every builder gets: the config, the run's task, policy and reward pool, and the specs built from the
    config once (``recipes.build``). ``whole``: the module engines sample from (a whole copy of the policy under
    FSDP2 on several ranks, ``sharded``); ``foreign``: the foreign model's engine, or None; ``reference``: the reference
    KL's frozen model (``build.reference_policy``), or None for the learner's default."""

    cfg: Config
    task: object
    policy: object
    pool: object
    world: World
    version: int
    engine: EngineSpec
    source: SourceSpec
    reward: RewardSpec
    whole: torch.nn.Module
    sharded: bool = False
    foreign: Engine | None = None
    check_round: Callable | None = None
    reference: torch.nn.Module | None = None


@dataclass(frozen=True)
class Backend:
    check: Callable[[Config], None]  # raises UserError for what this pair cannot run
    learner: Callable[[Inputs], LearnerProtocol]
    # (inputs, learner, evaluation engine) -> (source, weight sync, the evaluation engine's sync or None)
    source: Callable[[Inputs, LearnerProtocol, Engine], tuple[RolloutSource, WeightSync, CopySync | None]]
    # how its source hands the learner the behaviour distribution: "full" when the engine's model lives in the
    # learner's process; "rebuilt": rollout workers send sampled log-probs and their version, and the learner rebuilds
    # the model from the weights it pushed (weight_sync.BehaviourVersions: faithful for an engine declaring "full"),
    # except for an engine whose declaration is in WORKERS_SEND: its rows' distribution travels with the batch
    behaviour: str = "none"


# What a rollout worker's batch carries of its engine's distribution itself, instead of the learner rebuilding it:
# the top-k log-probs ([B, C, k], ``TrainBatch.behavior_top_logprobs``: the batch maps the version to ``TopK``), small
# beside the sampled tokens; a recorded whole distribution ([B, C, V] float32 per batch) is not sent
WORKERS_SEND = ("top_k",)


def workers_send(spec: EngineSpec) -> bool:
    """Whether rollout workers on an engine of ``spec`` hand the learner its behaviour distribution with each batch
    (``WORKERS_SEND``), so that no ``BehaviourVersions`` rebuilds it."""
    return behaviour_distribution(spec) in WORKERS_SEND


def learner_autocast(cfg: Config) -> torch.dtype | None:
    """The learner's autocast dtype, which engines sampling from its own module share (bf16-mixed), else None."""
    return precision_autocast(cfg.train.precision)


def precision_autocast(precision: str) -> torch.dtype | None:
    """The autocast dtype of a ``train.precision`` value: bfloat16 for bf16-mixed, None for float32."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def engine_autocast(inp: Inputs) -> torch.dtype | None:
    """The autocast dtype a rollout engine samples under: the learner's (``learner_autocast``) for an engine that
    computes as the learner does (a float32 transformers engine: the shared module, the lagged copy of
    ``rollout.staleness``, an async worker's copy, and the behaviour ``Teacher`` rebuilt for it); None for another
    precision or engine, which computes its own way. Async workers and the lagged copy sampled in float32 under
    bf16-mixed: every staleness-0 batch was off-policy (P3O's cap bound on ~half the tokens at async k = 0)."""
    return learner_autocast(inp.cfg) if shares_module(inp.engine) else None


def learner_options(cfg: Config) -> dict:
    """``objective.options`` as the learner takes them: with ``aggregation: seq_mean_token_sum`` and no
    ``seq_constant``, the constant is the generation budget ``rollout.max_new_tokens`` (Dr.GRPO's L_const, arXiv
    2503.20783 §3.4; TRL's ``dr_grpo`` and verl's ``seq-mean-token-sum-norm`` over responses padded to the budget),
    not the objective's own default (the batch's longest completion, which would rescale the loss every round)."""
    return objectives.with_budget_constant(dict(cfg.objective.options), cfg.rollout.max_new_tokens)


def _learner_kwargs(cfg: Config, version: int) -> dict:
    tr = cfg.train
    return dict(lr=tr.lr, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip, micro_batch_size=tr.micro_batch_size,
                ess_scope=tr.ess_scope, warmup_steps=tr.warmup_steps, epochs=tr.epochs, minibatches=tr.minibatches,
                version=version, max_bad_steps=tr.max_bad_steps, precision=tr.precision,
                activation_checkpointing=tr.activation_checkpointing, logprob_chunk_size=tr.logprob_chunk_size,
                diagnostics=tr.diagnostics, lr_schedule=tr.lr_schedule, total_steps=tr.steps * tr.epochs * tr.minibatches,
                betas=tuple(tr.adam_betas), eps=tr.adam_eps, padding_free=tr.padding_free,
                compile_backend="inductor" if tr.compile else None, temperature=learner_temperature(cfg))


def learner_temperature(cfg: Config) -> float:
    """π_θ's temperature in the loss (``objective.temperature``; ``rollout``: ``rollout.temperature``)."""
    t = cfg.objective.temperature
    return cfg.rollout.temperature if t == "rollout" else float(t)


def local_learner(inp: Inputs) -> Learner:
    """The learner in this process (data parallel over ``inp.world`` with DDP or FSDP2)."""
    cfg, tr = inp.cfg, inp.cfg.train
    # the reference KL's model; under LoRA by default the peft model, whose base the learner runs with adapters off
    reference = inp.reference if inp.reference is not None else inp.policy.adapter
    return Learner(inp.policy.model, cfg.objective.name, learner_options(cfg), world=inp.world,
                   # bf16-mixed is the learner's autocast under FSDP2 too, never FSDP2's MixedPrecisionPolicy(param_dtype=
                   # bf16): that casts the weights and the activations between blocks to bf16, which the rollout and
                   # evaluation engines (whole float32 copies under the same autocast) do not, so on-policy rounds
                   # were off-policy (P3O's cap bound on 61 % of round 1's tokens; test_fsdp2_end_to_end.py)
                   strategy=tr.strategy, reference=reference,
                   **_learner_kwargs(cfg, inp.version))


def ray_learner(inp: Inputs):
    """Learner ranks as Ray actors (``ray_learners``), or with ``ray_learners=0`` (or under torchrun) the local one.

    Raises:
        UserError: LoRA with Ray learner actors.
    """
    cfg = inp.cfg
    if cfg.ray_learners == 0 or inp.world.size > 1:
        return local_learner(inp)
    if inp.policy.adapter is not None:
        raise UserError("model.lora does not run with Ray learner actors (ray_learners) yet; set ray_learners=0")
    from ..orchestration.ray_learner import RayLearnerGroup

    return RayLearnerGroup(inp.policy.model, cfg.objective.name, learner_options(cfg), ranks=cfg.ray_learners,
                           seed=cfg.train.seed, address=cfg.ray_address, rollout_workers=cfg.rollout.workers,
                           **_learner_kwargs(cfg, inp.version))


def sync_engine(inp: Inputs, learner: LearnerProtocol):
    """The behaviour policy of a sync run and its weight sync: ``(engine, sync, shifted)``, pushed at the version.

    The engine is the learner's own module (on-policy: ``SharedSync``), or a copy in another precision or on
    another engine (``CopySync``; ``shifted``), or the policy of ``rollout.staleness`` optimizer steps ago
    (``LaggedSync``, the lab's shifts). ``inp.sharded`` (FSDP2 on several ranks): the engine samples from
    ``inp.whole``, a whole copy refilled by ``CopySync``.
    """
    cfg, policy, whole = inp.cfg, inp.policy, inp.whole
    ro, tr = cfg.rollout, cfg.train
    shifted = not shares_module(inp.engine) or ro.staleness > 0
    # an engine with its own copy gets the merged weights under the base's names (LoRA: a plain merged
    # copy to start from, then CopySync/LaggedSync push named_weights, merged); a shared one runs
    # the learner's module itself, whose adapted layers compute W x + (α/r)·B A x; under FSDP2 the whole copy
    model = whole if inp.sharded else merged_copy(policy.model) if shifted and policy.adapter is not None else whole
    engine = make_engine(inp.engine, policy, model=model, share=not shifted, version=inp.version,
                         autocast=engine_autocast(inp))
    if ro.staleness > 0:
        sync = LaggedSync(engine, ro.staleness, keep=ro.staleness + tr.epochs * tr.minibatches)
        learner.on_step.append(sync.record)
    elif shifted or inp.sharded:
        sync = CopySync(engine)
    else:
        sync = SharedSync(engine)
    sync.push(policy.model, inp.version)
    return engine, sync, shifted


def sync_source(inp: Inputs, learner: LearnerProtocol, eval_engine: Engine):
    """Sampling in the trainer's process each round (``SyncSource``) from ``sync_engine``'s engine."""
    engine, sync, shifted = sync_engine(inp, learner)
    policy, train = inp.policy, inp.task.train
    # the run's pool scores held-out data; training shares it only when it is the training reward (weighted functions,
    # a reward model, or a held-out file of another format have their own); the reward model on the learner's device
    rw = inp.cfg.reward
    load = functools.partial(load_reward_model, device=inp.world.device, batch_size=rw.model_batch_size)
    pool = inp.pool if inp.reward.name == getattr(inp.pool, "name", None) else inp.reward.pool(load_model=load)
    if pool is not inp.pool:
        pool.in_process_marker = inp.pool.in_process_marker
    source = SyncSource(engine, [policy.encode_prompt(e.prompt) for e in train], [e.reference for e in train],
                        pool, policy.decode, inp.source, pad_id=policy.pad_id, foreign=inp.foreign,
                        foreign_fraction=inp.cfg.rollout.foreign_fraction if inp.foreign is not None else 0.0,
                        world=inp.world, check_round=inp.check_round, contexts=[e.context() for e in train],
                        owns_pool=pool is not inp.pool, long_prompts=inp.task.long_prompts)
    # on-policy float32 under FSDP2, the rollout engine's whole copy is the evaluation's too, refilled every round
    return source, sync, CopySync(eval_engine) if inp.sharded and shifted else None


def _worker_spec(inp: Inputs) -> WorkerSpec:
    """What each rollout worker builds (``rollout.mode=async``), from the run's specs.

    Raises:
        UserError: a combination the async pipeline does not run (simulated staleness, foreign data, several
            data-parallel ranks).
    """
    if inp.world.size > 1:
        _refuse_async("several data-parallel ranks")
    train = inp.task.train
    # a worker's module stays in its process: the learner rebuilds each batch's behaviour (``_exact_behaviour``),
    # unless the worker sends it: then the batch maps the worker's version to its engine's ``teacher`` (``TopK``)
    sends = inp.source.behaviour_models and workers_send(inp.engine)
    return WorkerSpec(model_dir="", prompts=[inp.policy.encode_prompt(e.prompt) for e in train],
                      references=[e.reference for e in train], engine=inp.engine,
                      source=dataclasses.replace(inp.source, behaviour_models=sends),
                      reward=inp.reward, contexts=[e.context() for e in train], long_prompts=inp.task.long_prompts,
                      autocast=str(d).removeprefix("torch.") if (d := engine_autocast(inp)) is not None else None)


def _bounds(inp: Inputs) -> dict:
    """The async source's bound, workers and fault limit: ``AsyncSource``'s and ``ray_source``'s keywords."""
    ro, tr = inp.cfg.rollout, inp.cfg.train
    return dict(version=inp.version, workers=ro.workers, max_staleness=ro.max_staleness, async_order=ro.async_order,
                steps_per_round=tr.epochs * tr.minibatches, worker_timeout_s=ro.worker_timeout_s)


def _exact_behaviour(inp: Inputs, source: BoundedSource) -> WeightSync:
    """The async source's weight sync: its transport, or where the objective needs the behaviour distribution
    (kl=exact) ``BehaviourVersions`` around it, which keeps the pushed versions a batch in flight may carry and
    names each batch's behaviour model (``source.behaviour``); not where the workers send it (``workers_send``)."""
    if not inp.source.behaviour_models or workers_send(inp.engine):
        return source.sync
    sp = inp.source.sampling
    source.behaviour = BehaviourVersions(source.sync, inp.policy.model, version=inp.version,
                                         max_lag=source.controller.k_max if source.controller else source.k,
                                         temperature=1.0 if sp.greedy else sp.temperature,
                                         autocast=engine_autocast(inp))
    return source.behaviour


def process_source(inp: Inputs, learner: LearnerProtocol, eval_engine: Engine):
    """Rollout workers in processes of this machine, bounded by ``rollout.max_staleness``."""
    source = AsyncSource(_worker_spec(inp), inp.policy, **_bounds(inp))
    return source, _exact_behaviour(inp, source), None


def ray_source(inp: Inputs, learner: LearnerProtocol, eval_engine: Engine):
    """Rollout workers as Ray actors (``ray_address``); ray is imported only in there."""
    from ..orchestration.ray_learner import RayLearnerGroup  # imports no ray
    from ..orchestration.ray_rollout import ray_source as build

    source: BoundedSource = build(_worker_spec(inp), inp.policy, address=inp.cfg.ray_address, **_bounds(inp))
    if isinstance(learner, RayLearnerGroup):  # the actors read learner rank 0's weights; they end together
        source.transport.weights_from = learner.weights_at
        source.on_close.append(learner.close)
    return source, _exact_behaviour(inp, source), None


def _refuse_async(why: str) -> None:
    raise UserError(f"rollout.mode=async does not run with {why} yet; use rollout.mode=sync for it")


def _check_async(cfg: Config) -> None:
    """What the async pipeline does not run, known from the config alone (before any model is built)."""
    ro = cfg.rollout
    for bad, why in ((ro.staleness > 0, "rollout.staleness (the simulated lag; use rollout.max_staleness)"),
                     (ro.foreign_fraction > 0, "rollout.foreign_fraction")):
        if bad:
            _refuse_async(why)


def _check_ray_learners(cfg: Config) -> None:
    if cfg.ray_learners > 0 and cfg.train.strategy == "fsdp2":
        raise UserError("train.strategy=fsdp2 runs under torchrun; the Ray learner group (ray_learners) uses DDP: "
                        "set train.strategy=ddp or ray_learners=0")
    if cfg.ray_learners > 0 and cfg.model.lora is not None:
        raise UserError("model.lora does not run with Ray learner actors (ray_learners) yet; set ray_learners=0")


def _check_async_ray(cfg: Config) -> None:
    from ..orchestration.ray_cluster import check_ray  # imports no ray

    _check_async(cfg)
    _check_ray_learners(cfg)
    check_ray(cfg.ray_address)


def _refuse_sync_ray(cfg: Config) -> None:
    _check_ray_learners(cfg)
    raise UserError("orchestrator=ray runs the rollout workers of rollout.mode=async; add rollout.mode=async")


BACKENDS: dict[tuple[str, str], Backend] = {
    ("sync", "local"): Backend(lambda cfg: None, local_learner, sync_source, behaviour="full"),
    ("async", "local"): Backend(_check_async, local_learner, process_source, behaviour="rebuilt"),
    ("async", "ray"): Backend(_check_async_ray, ray_learner, ray_source, behaviour="rebuilt"),
    # Ray runs rollout workers, which a sync run has none of: refused by its check, before anything is built
    ("sync", "ray"): Backend(_refuse_sync_ray, ray_learner, sync_source, behaviour="full"),
}


def backend_for(cfg: Config) -> Backend:
    """The ``Backend`` of ``(cfg.rollout.mode, cfg.orchestrator)``.

    Raises:
        UserError: a pair no backend is registered for.
    """
    try:
        return BACKENDS[(cfg.rollout.mode, cfg.orchestrator)]
    except KeyError:
        raise UserError(f"rollout.mode={cfg.rollout.mode} does not run with orchestrator={cfg.orchestrator}; "
                        f"use one of {', '.join(f'{m}/{o}' for m, o in BACKENDS)}") from None
