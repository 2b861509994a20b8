"""Build a run's parts from the configuration, in one place: task, policy, reward pool, engines, sync, learner, source.

Components take plain arguments; this module is where ``Config`` is read and turned into them. A new
backend (the vLLM engine, an async source, a Ray learner group) is one more branch here, never in the loop.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import objectives, rewards
from ..config import Config
from ..data import load_task
from ..data.benchmarks import fit_prompts, load_file_task
from ..errors import UserError
from ..orchestration.process_rollout import AsyncSource
from ..orchestration.rollout_worker import WorkerSpec
from ..pipeline.async_source import BoundedSource
from ..pipeline.source import SyncSource
from ..pipeline.weight_sync import CopySync, LaggedSync, SharedSync
from ..policy import load_policy
from ..policy.base import default_base
from ..policy.lora import adapter_base, apply_lora, merged_copy, read_adapter, restore_adapter
from ..rollout import NOT_THE_POLICY, SamplingParams, TransformersEngine
from ..trainer.learner import Learner
from ..trainer.loop import Parts
from ..parallel import World


def configured_task(cfg: Config):
    """The task split that ``cfg.data`` (files) or else ``cfg.task`` (reasoning-gym) describes."""
    if cfg.data.train:
        return load_file_task(cfg.data)
    return load_task(cfg.task.name, train_size=cfg.task.train_size, heldout_size=cfg.task.heldout_size,
                     seed=cfg.task.seed, params=cfg.task.params)


def task_key(cfg: Config) -> dict:
    """What determines the task's prompts, for the default base's cache key."""
    return cfg.data.model_dump(mode="json") if cfg.data.train else cfg.task.model_dump(mode="json")


def check_objective(cfg: Config) -> None:
    """Fail before any work when the objective's options or ESS scope are invalid, or need full behaviour
    log-probs (kl="exact") that the rollout cannot give (vLLM engine, top-p < 1, async workers).

    Raises:
        UserError: one line naming the option and the fix.
    """
    try:
        # the transformers engine returns full behaviour log-probs; where the rollout cannot, refused below
        objectives.validate_options(cfg.objective.name, cfg.objective.options, supplied=("behavior_logprobs_full",))
        spec = objectives.spec(cfg.objective.name)
    except ValueError as e:
        raise UserError(f"invalid objective.options for {cfg.objective.name!r}: {e}") from None
    if spec.batch_stats and cfg.train.ess_scope not in spec.ess_scopes:
        raise UserError(f"objective {cfg.objective.name!r} supports train.ess_scope in {spec.ess_scopes}, "
                        f"not {cfg.train.ess_scope!r}")
    cause = spec.full_logprobs_cause(cfg.objective.options)
    if cause is not None:
        ro = cfg.rollout
        why = ("the vllm engine returns top-k log-probs only, not the whole distribution; use rollout.engine=transformers"
               if ro.engine == "vllm" else
               f"top-p sampling (rollout.top_p={ro.top_p:g}) gives π_b = 0 outside the nucleus, where KL(π_θ‖π_b) is "
               "infinite; set rollout.top_p=1.0" if ro.top_p < 1.0 else
               "the async rollout workers do not send full log-probs; use rollout.mode=sync"
               if ro.mode == "async" else None)
        if why is not None:
            raise UserError(f"objective.options {cause} needs the behaviour policy's full log-probs: {why}, "
                            f"or use kl='k3'")


def preflight(cfg: Config) -> None:
    """Every check that needs no model or data, run before the run directory is touched.

    Raises:
        UserError: invalid objective options or ESS scope; an optional engine or orchestrator that is not
            installed.
    """
    import importlib.util

    check_objective(cfg)
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from ..rollout.vllm_engine import MISSING_VLLM

        raise UserError(MISSING_VLLM)
    check_orchestrator(cfg)


def check_orchestrator(cfg: Config) -> None:
    """``orchestrator=ray`` runs the async rollout workers as Ray actors: it needs that mode and Ray.

    Raises:
        UserError: ``orchestrator=ray`` with ``rollout.mode=sync``, or without Ray installed (names the extra), or
            an address that does not answer, or Ray learners with ``train.strategy=fsdp2``.
    """
    if cfg.orchestrator != "ray":
        return
    if cfg.ray_learners > 0 and cfg.train.strategy == "fsdp2":
        raise UserError("train.strategy=fsdp2 runs under torchrun; the Ray learner group (ray_learners) uses DDP: "
                        "set train.strategy=ddp or ray_learners=0")
    if cfg.rollout.mode != "async":
        raise UserError("orchestrator=ray runs the rollout workers of rollout.mode=async; add rollout.mode=async")
    from ..orchestration.ray_cluster import check_ray  # imports no ray

    check_ray(cfg.ray_address)


def scoring_check(cfg: Config, task, console, where: str = "a rollout round"):
    """``check_round(result, n)`` for the rollout source and held-out evaluation: warn on any scorer failure,
    stop past ``reward.max_failure_rate``; ``where`` names what was scored in the messages."""
    scorer = cfg.reward.name or task.reward

    def check(result, n):
        warning = rewards.check_scoring(result, n=n, scorer=scorer, max_failure_rate=cfg.reward.max_failure_rate,
                                        where=where)
        if warning and console is not None:
            console.print(f"[yellow]{warning}[/yellow]", highlight=False)

    return check


def fit_to_context(task, policy, max_new_tokens: int, console=None):
    """Drop (with a warning) the prompts that leave no room for ``max_new_tokens`` in the model's context.

    Raises:
        UserError: no prompt of a split fits.
    """
    context = getattr(policy.model.config, "max_position_embeddings", None)
    for split in ("train", "heldout"):
        examples = getattr(task, split)
        keep, warning = fit_prompts([len(policy.encode_prompt(e.prompt)) for e in examples], context=context,
                                    max_new_tokens=max_new_tokens, where=f"the {split} prompts")
        if warning:
            setattr(task, split, [examples[i] for i in keep])
            if console is not None:
                console.print(f"[yellow]{warning}[/yellow]", highlight=False)


def prepare_run(cfg: Config, console=None):
    """Task, policy, reward pool: everything a run, SFT or eval needs from the config.

    Prompts that do not fit the model's context with ``rollout.max_new_tokens`` are dropped (warned).
    With ``model.lora`` the policy gets LoRA adapters (``policy.lora.apply_lora``; only they train),
    naming the base directory (``model.path`` or the default base's cache folder) for checkpoints.
    Returns ``(task, policy, pool, source)``; ``source`` says where the policy came from.
    """
    task = configured_task(cfg)
    pool = rewards.RewardPool(cfg.reward.name or task.reward, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
    if cfg.model.path:
        policy, source = load_policy(cfg.model.path), cfg.model.path
        base = str(Path(cfg.model.path).expanduser().resolve())
    else:
        if console:
            console.print("[dim]building or loading the cached default base model (SFT warm-up)…[/dim]")
        policy, path, built = default_base(task, task_key(cfg), cfg.model.model_dump(mode="json"))
        source, base = f"{path} ({'built now' if built else 'cached'})", str(path)
    fit_to_context(task, policy, cfg.rollout.max_new_tokens, console)
    if cfg.model.lora is not None:
        lo = cfg.model.lora
        try:
            apply_lora(policy, r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules,
                       base=base, seed=cfg.model.seed)
        except BaseException:
            pool.close()
            raise
        source += f" + LoRA r={lo.r} alpha={lo.alpha:g}"
    return task, policy, pool, source


def checkpoint_loader(cfg: Config):
    """What ``trainer.checkpoint.load_latest`` reads a checkpoint's policy with: the full policy, or with
    ``model.lora`` the adapter's tensors (``restore_checkpoint_policy`` puts them into the run's policy)."""
    return read_adapter if cfg.model.lora is not None else load_policy


def restore_checkpoint_policy(cfg: Config, policy, ckpt, loaded):
    """The policy a resume continues from: the checkpoint's (full fine-tuning), or the run's own base
    (``prepare_run``) with the checkpoint's adapter restored exactly (``model.lora``).

    Raises:
        UserError: the checkpoint's adapter names another base than this run's (a moved cache or model.path).
    """
    if cfg.model.lora is None:
        return loaded
    saved, now = adapter_base(ckpt), policy.adapter.peft_config["default"].base_model_name_or_path
    if saved != now:
        raise UserError(f"the LoRA checkpoint {ckpt.name} was trained on base {saved!r} but this run's base is "
                        f"{now!r}; put the base back there (model.path, or TRUSTBATCH_CACHE for the default base)")
    restore_adapter(policy, loaded)
    return policy


def _full_logprobs(cfg: Config) -> bool:
    """Whether the configured objective needs the engines to record full behaviour log-probs (kl="exact")."""
    return objectives.spec(cfg.objective.name).needs_full_logprobs(cfg.objective.options)


def foreign_engine(cfg: Config, task, policy) -> TransformersEngine:
    """An engine on another model that shares the policy's tokenizer (``rollout.foreign_model``); never synced.

    It runs on the policy's device.

    Raises:
        UserError: the foreign model's tokenizer differs from the policy's.
    """
    spec = cfg.rollout.foreign_model
    if spec == "initial":
        other = copy.deepcopy(policy.model)  # the frozen starting checkpoint
    else:
        if isinstance(spec, dict):
            foreign_policy, _, _ = default_base(task, task_key(cfg), {**cfg.model.model_dump(mode="json"), **spec})
        else:
            foreign_policy = load_policy(spec)
        if foreign_policy.tokenizer.get_vocab() != policy.tokenizer.get_vocab():
            raise UserError(f"rollout.foreign_model {spec!r} has another tokenizer; foreign data must share the policy's")
        other = foreign_policy.model
    other = other.to(next(policy.model.parameters()).device)
    return TransformersEngine(other, policy.eos_id, policy.pad_id, version=NOT_THE_POLICY,
                              full_logprobs=_full_logprobs(cfg))


@dataclass
class Built:
    parts: Parts
    eval_engine: TransformersEngine  # the learner's own float32 policy (or a whole copy of it), for held-out evaluation
    # under FSDP2, when the rollout engine holds another precision or older weights: fills the evaluation's whole
    # float32 copy before each evaluation (every rank pushes: the shards are gathered)
    eval_sync: CopySync | None = None


def build_learner(cfg: Config, policy, world: World, version: int):
    """The learner (``Learner``, or Ray learner actors with ``orchestrator=ray`` and ``ray_learners > 0``).

    Raises:
        UserError: LoRA with Ray learner actors.
    """
    ro, tr = cfg.rollout, cfg.train
    learner_kw = dict(lr=tr.lr, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
                      micro_batch_size=tr.micro_batch_size, ess_scope=tr.ess_scope, warmup_steps=tr.warmup_steps,
                      epochs=tr.epochs, minibatches=tr.minibatches, version=version, max_bad_steps=tr.max_bad_steps,
                      precision=tr.precision, activation_checkpointing=tr.activation_checkpointing,
                      logprob_chunk_size=tr.logprob_chunk_size)
    if cfg.orchestrator == "ray" and cfg.ray_learners > 0 and world.size == 1:  # learner ranks as Ray actors
        if policy.adapter is not None:
            raise UserError("model.lora does not run with Ray learner actors (ray_learners) yet; set ray_learners=0")
        from ..orchestration.ray_learner import RayLearnerGroup

        return RayLearnerGroup(policy.model, cfg.objective.name, cfg.objective.options, ranks=cfg.ray_learners,
                               seed=tr.seed, address=cfg.ray_address, rollout_workers=ro.workers, **learner_kw)
    # FSDP2's own mixed precision (bf16 compute weights, float32 shards and reductions) beside the autocast
    param_dtype = torch.bfloat16 if tr.strategy == "fsdp2" and tr.precision == "bf16-mixed" else None
    return Learner(policy.model, cfg.objective.name, cfg.objective.options, world=world, strategy=tr.strategy,
                   param_dtype=param_dtype, **learner_kw)


def _learner_autocast(cfg: Config):
    """The learner's autocast dtype, which engines sampling from its own module share (bf16-mixed), else None."""
    return torch.bfloat16 if cfg.train.precision == "bf16-mixed" else None


def sync_engine(cfg: Config, policy, learner, version: int, *, whole=None, sharded: bool = False):
    """The behaviour policy of a sync run and its weight sync: ``(engine, sync)``, the sync pushed at ``version``.

    The engine is the learner's own module (on-policy: ``SharedSync``), or a copy in another precision or on vLLM
    (``CopySync``), or the policy of ``rollout.staleness`` optimizer steps ago (``LaggedSync``, the lab's shifts).
    ``sharded`` (FSDP2 on several ranks): the engine samples from ``whole``, a whole copy refilled by ``CopySync``.
    """
    ro, tr = cfg.rollout, cfg.train
    whole = policy.model if whole is None else whole
    shifted = ro.precision != "float32" or ro.staleness > 0 or ro.engine == "vllm"
    if ro.engine == "vllm":
        engine = vllm_engine(cfg, dataclasses.replace(policy, model=whole), version)
    else:
        # an engine with its own copy gets the merged weights under the base's names (LoRA: a plain merged
        # copy to start from, then CopySync/LaggedSync push named_weights, merged); a shared one runs
        # the learner's module itself, whose adapted layers compute W x + (α/r)·B A x; under FSDP2 the whole copy
        model = whole if sharded else merged_copy(policy.model) if shifted and policy.adapter is not None else whole
        engine = TransformersEngine(model, policy.eos_id, policy.pad_id, precision=ro.precision, share=not shifted,
                                    version=version, full_logprobs=_full_logprobs(cfg),
                                    autocast=None if shifted else _learner_autocast(cfg))
    if ro.staleness > 0:
        sync = LaggedSync(engine, ro.staleness, keep=ro.staleness + tr.epochs * tr.minibatches)
        learner.on_step.append(sync.record)
    elif shifted or sharded:
        sync = CopySync(engine)
    else:
        sync = SharedSync(engine)
    sync.push(policy.model, version)
    return engine, sync


def build_parts(cfg: Config, task, policy, pool, *, foreign=None, world: World | None = None,
                version: int = 0, check_round=None) -> Built:
    """The engine and its weight sync, the learner and the rollout source for ``policy`` at ``version``.

    With ``train.strategy=fsdp2`` on several ranks the learner's module is sharded, so the engines
    sample from a whole copy taken before sharding (merged, under LoRA), which weight syncs refill with
    gathered tensors: a sharded module's forward waits on every rank, and ranks generate different lengths.
    """
    world = world or World()
    ro, tr = cfg.rollout, cfg.train
    check_orchestrator(cfg)
    sharded = tr.strategy == "fsdp2" and world.size > 1
    whole = policy.model  # before the learner shards policy.model
    if sharded:
        whole = merged_copy(policy.model) if policy.adapter is not None else copy.deepcopy(policy.model)
    learner = build_learner(cfg, policy, world, version)
    # the held-out evaluation samples from the learner's own module (or its whole copy), as the learner computes
    eval_engine = TransformersEngine(whole, policy.eos_id, policy.pad_id, autocast=_learner_autocast(cfg))
    if ro.mode == "async":
        try:
            source = async_source(cfg, task, policy, version, world)
        except BaseException:
            getattr(learner, "close", lambda: None)()
            raise
        if hasattr(learner, "weights_at"):  # the rollout actors read learner rank 0's weights; they end together
            source.transport.weights_from = learner.weights_at
            source.on_close.append(learner.close)
        return Built(Parts(source, learner, source.sync), eval_engine)
    engine, sync = sync_engine(cfg, policy, learner, version, whole=whole, sharded=sharded)
    source = SyncSource(
        engine, [policy.encode_prompt(e.prompt) for e in task.train], [e.reference for e in task.train], pool,
        policy.decode, sampling=SamplingParams(temperature=ro.temperature, top_p=ro.top_p,
                                               max_new_tokens=ro.max_new_tokens),
        group_size=ro.group_size, prompts_per_step=ro.prompts_per_step, pad_id=policy.pad_id, seed=tr.seed,
        dynamic_sampling=ro.dynamic_sampling, max_sampling_rounds=ro.max_sampling_rounds,
        overlong_cache=ro.overlong_cache, advantage=cfg.objective.advantage, std=cfg.objective.std,
        foreign=foreign, foreign_fraction=ro.foreign_fraction if foreign is not None else 0.0, world=world,
        check_round=check_round,
    )
    # on-policy float32 under FSDP2, the rollout engine's whole copy is the evaluation's too, refilled every round
    return Built(Parts(source, learner, sync), eval_engine, CopySync(eval_engine) if sharded and shifted else None)


def vllm_engine(cfg: Config, policy, version: int):
    """A colocated vLLM engine on a copy of the policy written to a temporary HF directory (``rollout.engine=vllm``).

    The learner's threads are already set (an in-process vLLM makes ``torch.set_num_threads`` a no-op).

    Raises:
        UserError: vLLM is not installed (names the extra), or the model or setting cannot run on it.
    """
    import atexit
    import shutil
    import tempfile

    ro = cfg.rollout
    if ro.precision == "int8":
        raise UserError("rollout.engine=vllm runs in float32, bfloat16 or float16; for 8-bit weights use "
                        "rollout.quantization=fp8_per_channel")
    model_dir = tempfile.mkdtemp(prefix="trustbatch-vllm-model-")
    atexit.register(shutil.rmtree, model_dir, True)
    policy.save(model_dir)
    try:
        from ..rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, policy.eos_id, policy.pad_id, precision=ro.precision,
                          quantization=ro.quantization, seed=cfg.train.seed, threads=cfg.threads or None,
                          version=version,
                          # prompts that do not fit were dropped by prepare_run; vLLM needs the bound stated
                          max_model_len=getattr(policy.model.config, "max_position_embeddings", None))
    except (ImportError, ValueError) as e:
        raise UserError(str(e).splitlines()[0]) from None


def async_source(cfg: Config, task, policy, version: int, world: World) -> BoundedSource:
    """Rollout workers (``rollout.mode=async``), bounded by ``rollout.max_staleness``: processes of this
    machine, or Ray actors with ``orchestrator=ray`` (``ray_address``).

    Raises:
        UserError: a combination the async pipeline does not run (simulated staleness, foreign data,
            several data-parallel ranks); ``orchestrator=ray`` without Ray installed.
    """
    ro, tr = cfg.rollout, cfg.train
    for bad, why in ((ro.staleness > 0, "rollout.staleness (the simulated lag; use rollout.max_staleness)"),
                     (ro.foreign_fraction > 0, "rollout.foreign_fraction"),
                     (world.size > 1, "several data-parallel ranks")):
        if bad:
            raise UserError(f"rollout.mode=async does not run with {why} yet; use rollout.mode=sync for it")
    spec = WorkerSpec(
        model_dir="", prompts=[policy.encode_prompt(e.prompt) for e in task.train],
        references=[e.reference for e in task.train], reward=cfg.reward.name or task.reward,
        sampling=SamplingParams(temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens),
        group_size=ro.group_size, prompts_per_step=ro.prompts_per_step, seed=tr.seed, precision=ro.precision,
        reward_workers=cfg.reward.workers, reward_timeout_s=cfg.reward.timeout_s,
        max_failure_rate=cfg.reward.max_failure_rate, dynamic_sampling=ro.dynamic_sampling,
        max_sampling_rounds=ro.max_sampling_rounds, overlong_cache=ro.overlong_cache,
        advantage=cfg.objective.advantage, std=cfg.objective.std, engine=ro.engine, quantization=ro.quantization)
    kw = dict(version=version, workers=ro.workers, max_staleness=ro.max_staleness,
              steps_per_round=tr.epochs * tr.minibatches, worker_timeout_s=ro.worker_timeout_s)
    if cfg.orchestrator == "ray":  # the same rules over Ray actors; ray is imported only in there
        from ..orchestration.ray_rollout import ray_source

        return ray_source(spec, policy, address=cfg.ray_address, **kw)
    return AsyncSource(spec, policy, **kw)
