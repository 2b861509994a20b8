"""Build a run's parts from the configuration, in one place: specs, task, policy, reward pool, engines, parts.

Components take plain arguments; this module is where ``Config`` is read and turned into them: the specs
(``EngineSpec``, ``SourceSpec``, ``RewardSpec``) are built here once, and ``build_parts`` looks the learner and
source builders of the run's ``(rollout.mode, orchestrator)`` up in ``backends.BACKENDS``. A new backend is one
more entry there, never a branch here or in the loop.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from .. import objectives
from ..config import Config
from ..data import load_task
from ..data.benchmarks import NO_SCORER, fit_prompts, limit_prompts, load_file_task, questions_in_place
from ..data.tasks import LongPrompts
from ..errors import UserError
from ..pipeline.source import SourceSpec
from ..pipeline.weight_sync import CopySync
from ..policy import load_policy
from ..policy.base import default_base
from ..policy.hub import model_dir
from ..policy.budget import vocab_size
from ..policy.lora import adapter_base, apply_lora, merged_copy, read_adapter, restore_adapter
from ..policy.sft import demos_within_context
from ..rewards.scorers import MODEL_PREFIX, is_model
from ..rewards.spec import RewardSpec
from ..rollout import NOT_THE_POLICY, Engine, EngineSpec, SamplingParams, check_engine, make_engine
from ..rollout.spec import check_temperature
from ..trainer.loop import Parts
from .base import load_default_base
from ..parallel import World
from .backends import Inputs, backend_for, learner_autocast
from .checks import (check_learner, check_objective, check_orchestrator, check_recorded_behaviour, check_reward,
                     check_shaping)

__all__ = ["Built", "build_parts", "check_objective", "check_orchestrator", "checkpoint_loader", "configured_task",
           "engine_spec", "foreign_engine", "preflight", "prepare_run", "reference_policy", "restore_checkpoint_policy",
           "reward_spec", "scoring_check", "source_spec", "task_key"]


def engine_spec(cfg: Config) -> EngineSpec:
    """The rollout engine's settings (``rollout.engine``, ``precision``, ``quantization``, ``decode``, ``noise``)."""
    ro = cfg.rollout
    # record where the exact KL needs the whole distribution and teacher forcing would not rebuild it (the engine
    # declares "recorded" at this precision; check_recorded_behaviour bounds its size), or the top-k ("top_k")
    return EngineSpec(name=ro.engine, precision=ro.precision, quantization=ro.quantization,
                      seed=cfg.train.seed, threads=cfg.threads or None, top_k=ro.logprobs_top_k, decode=ro.decode,
                      noise=ro.noise,
                      record=objectives.spec(cfg.objective.name).needs_full_logprobs(cfg.objective.options))


def source_spec(cfg: Config) -> SourceSpec:
    """How each round's batch is sampled, filtered, shaped and given advantages (``rollout``, ``objective``); with
    the behaviour models where the objective needs whole distributions."""
    ro = cfg.rollout
    return SourceSpec(SamplingParams(temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens),
                      group_size=ro.group_size, prompts_per_step=ro.prompts_per_step, seed=cfg.train.seed,
                      prompt_order=ro.prompt_order,
                      behaviour_models=objectives.spec(cfg.objective.name).needs_full_logprobs(cfg.objective.options),
                      dynamic_sampling=ro.dynamic_sampling, max_sampling_rounds=ro.max_sampling_rounds,
                      overlong_cache=ro.overlong_cache, advantage=cfg.objective.advantage, std=cfg.objective.std,
                      max_steps=optimizer_steps(cfg))


def optimizer_steps(cfg: Config) -> int:
    """The run's optimizer steps: ``train.steps`` rounds of ``train.epochs × train.minibatches``."""
    return cfg.train.steps * cfg.train.epochs * cfg.train.minibatches


def reward_spec(cfg: Config, task, *, heldout: bool = False) -> RewardSpec:
    """The training reward: ``reward.name`` (default: the data's scorer), or ``reward.functions`` as (name, weight)
    terms, with ``reward.model`` as one more term ``rm:DIR`` (``rewards.functions``); its pool's settings and failure
    limit. ``heldout``: the former, as held-out evaluation scores (pass@1 counts correct answers), with a
    ``data.heldout`` file's own scorer as the data's; with ``eval.reward=functions``, and on data without answers
    (``data.format=prompts``, no scorer of its own), the training reward's functions (``reward.name`` or
    ``reward.functions``; a reward model scores training alone).

    Raises:
        UserError: data without answers and neither ``reward.name`` nor a reward function to score it;
            ``eval.reward=functions`` without either; a plain-answer scorer on data without plain answers
            (``check_answer_scorers``).
    """
    rw = cfg.reward
    terms = tuple((f.name, f.weight) for f in rw.functions)
    functions = tuple(t for t in terms if not is_model(t[0]))  # what held-out evaluation can score with
    if rw.model is not None:
        terms += ((MODEL_PREFIX + str(model_dir(rw.model, key="reward.model").resolve()), rw.model_weight),)
    # held-out evaluation scores a held-out file by its own scorer (trustbatch eval -b FILE does too)
    # (a held-out file without answers is its own case: "" is falsy, and the train data's scorer took its place)
    held = getattr(task, "heldout_reward", None) if heldout else None
    data_scorer = held if held is not None else task.reward
    check_answer_scorers([rw.name] + [f.name for f in rw.functions], data_scorer)
    if heldout and cfg.eval.reward == "functions":  # check_reward refused it without a function
        data_scorer = NO_SCORER
    if data_scorer == NO_SCORER and not (rw.name or (functions if heldout else terms)):
        what = "the held-out data has" if held == NO_SCORER and task.reward != NO_SCORER else "this data has"
        alone = (" (a reward model alone scores training, not held-out evaluation, which is scored in its own "
                 "pool)" if heldout and terms else "")
        raise UserError(f"{what} prompts and no answers (no 'answer' field: data.format=prompts), so it has no scorer "
                        f"of its own{alone}; give reward functions (reward.functions, the Python API's reward_funcs) "
                        "or reward.name=module:function, or name the answer field: data.answer_field=...")
    name = terms if terms and not heldout else rw.name or data_scorer or functions
    return RewardSpec(name, workers=rw.workers, timeout_s=rw.timeout_s, max_failure_rate=rw.max_failure_rate)


# the built-in scorers that read a plain answer, and the data scorers whose references are JSON (a task's entry, a
# Countdown problem): the former on the latter would score against the JSON's last number, without a word
_PLAIN_ANSWER_SCORERS = ("gsm8k", "math")


def check_demonstrations(task, what: str) -> None:
    """Refuse an SFT (``what``) on data whose rows have no answers (``data.format=prompts``): its demonstrations
    would be empty.

    Raises:
        UserError: naming ``what`` and the fixes.
    """
    if task.reward == NO_SCORER:
        raise UserError(f"{what} needs answers to learn from, and this data has prompts alone (data.format=prompts); "
                        "give model.path (a model to start from), or data with an answer field")


def check_answer_scorers(names: list[str | None], data_scorer: str,
                         other: str | None = "train on data with plain answers (data.train=FILE)") -> None:
    """Refuse a plain-answer scorer (``gsm8k``, ``math``) among ``names`` on data whose references are JSON
    (reasoning-gym tasks, Countdown): it would score the last number of the JSON. ``other``: a second fix, or None.

    Raises:
        UserError: one such name, with the data's own scorer.
    """
    wrong = next((n for n in names if n in _PLAIN_ANSWER_SCORERS), None)
    if wrong is not None and data_scorer == NO_SCORER:
        raise UserError(f"reward {wrong!r} compares with a gold answer, but this data has none (no 'answer' field: "
                        "data.format=prompts); name the answer field (data.answer_field=...), or give reward functions "
                        "that need no answer")
    if not (data_scorer.startswith(("rg:", "rg-final:")) or data_scorer == "countdown"):
        return
    if wrong is not None:
        raise UserError(f"reward {wrong!r} reads a plain answer, but this data's answers are JSON, scored by "
                        f"{data_scorer!r}; drop it to use {data_scorer!r}" + (f", or {other}" if other else ""))


def preflight(cfg: Config) -> None:
    """Every check that needs no model or data, run before the run directory is touched.

    Raises:
        UserError: invalid objective options or ESS scope; an optional engine or orchestrator that is not
            installed; an engine setting the engine does not run, or a temperature below its lowest; a reward model that is none, or where the run
            cannot hold it; a ``model.reference`` the run would ignore or cannot load; a reference KL with Ray
            learner actors (``checks.check_learner``); an overlong zone longer than the completion budget
            (``checks.check_shaping``).
    """
    check_objective(cfg)
    check_shaping(cfg)
    check_learner(cfg)
    check_engine(engine_spec(cfg))
    check_temperature(engine_spec(cfg), cfg.rollout.temperature, "rollout.temperature")
    check_orchestrator(cfg)
    check_reward(cfg)


def configured_task(cfg: Config):
    """The task split that ``cfg.data`` (files) or else ``cfg.task`` (reasoning-gym) describes."""
    if cfg.data.train:
        return load_file_task(cfg.data)
    return load_task(cfg.task.name, train_size=cfg.task.train_size, heldout_size=cfg.task.heldout_size,
                     seed=cfg.task.seed, params=cfg.task.params)


def task_key(cfg: Config) -> dict:
    """What determines the task's prompts, for the default base's cache key."""
    # the prompt format is not the task's: the default base's tokenizer has no chat template
    # nor how long prompts are cut (the base is trained on its own prompts, before any limit applies); a run that
    # read no prompt column (data.prompt_column false, as every run before the key) keeps the key it had
    if not cfg.data.train:
        return cfg.task.model_dump(mode="json")
    return cfg.data.model_dump(mode="json", exclude={"chat_template", "system_prompt", "max_prompt_tokens",
                                                     "long_prompts"} | ({"prompt_column"} if not cfg.data.prompt_column
                                                                        else set()))


def scoring_check(cfg: Config, task, console, where: str = "a rollout round"):
    """``check_round(result, n)`` for the rollout source and held-out evaluation: warn on any scorer failure,
    stop past ``reward.max_failure_rate``; ``where`` names what was scored in the messages (a rollout round scores
    the training reward, anything else the held-out one: ``reward_spec``)."""
    warn = None if console is None else lambda w: console.print(f"[yellow]{w}[/yellow]", highlight=False)
    return reward_spec(cfg, task, heldout=where != "a rollout round").check(where, warn)


def questions_for_messages(task, policy, console=None) -> None:
    """Where ``policy`` cannot frame chat messages (no chat template; ``data.chat_template=off``; None: the default
    base, which has no template), a GSM8K, MATH or Countdown row whose ``prompt`` column holds them is prompted with
    its format's own question instead (``Example.question``), with a warning, as before that column was read; a row
    without one keeps its messages, which ``Policy.encode_prompt`` refuses in one line."""
    if policy is not None and policy.frames_messages:
        return
    swapped = 0
    for split in ("train", "heldout"):
        examples, n = questions_in_place(getattr(task, split))
        setattr(task, split, examples)
        swapped += n
    if swapped and console is not None:
        console.print(f"[yellow]warning: {questions_warning(swapped, 'data.chat_template')}[/yellow]", highlight=False)


def questions_warning(swapped: int, key: str) -> str:
    """What ``questions_for_messages`` (and ``trustbatch eval``) say of ``swapped`` rows; ``key``: the framing
    setting as the user gives it."""
    return (f"{swapped} rows' prompt column holds chat messages, which this model cannot frame (its tokenizer has no "
            f"chat template, or {key}=off): each is prompted with its question and the format's instruction instead")


def fit_to_context(task, policy, max_new_tokens: int, console=None) -> int:
    """Drop (with a warning) the prompts that leave no room for ``max_new_tokens`` in the model's context. Returns
    how many train prompts were dropped.

    Raises:
        UserError: no prompt of a split fits.
    """
    context = getattr(policy.model.config, "max_position_embeddings", None)
    dropped = 0
    for split in ("train", "heldout"):
        examples = getattr(task, split)
        keep, warning = fit_prompts([len(policy.encode_prompt(e.prompt)) for e in examples], context=context,
                                    max_new_tokens=max_new_tokens, where=f"the {split} prompts")
        if warning:
            setattr(task, split, [examples[i] for i in keep])
            dropped += (len(examples) - len(keep)) * (split == "train")
            if console is not None:
                console.print(f"[yellow]{warning}[/yellow]", highlight=False)
    return dropped


def fit_demos(policy, demos: list[tuple[str, str]], console=None) -> list[tuple[str, str]]:
    """The SFT demonstrations (prompt, completion) whose prompt and completion ids (EOS included) fit the model's
    context (``config.max_position_embeddings``); the others are dropped with one warning line. Past the context a
    model with learned positions fails with an index error and a RoPE model trains out of its range.

    Raises:
        UserError: none fits.
    """
    keep, lengths, context = demos_within_context(policy, demos)
    if context is None:
        return demos
    if not keep:
        raise UserError(f"none of the {len(demos)} SFT demonstrations fits the model's context of {context} tokens "
                        f"(the shortest prompt and answer have {min(lengths)}); give shorter rows, or set "
                        "data.max_prompt_tokens with data.long_prompts=truncate")
    if len(keep) < len(demos) and console is not None:
        console.print(f"[yellow]warning: skipped {len(demos) - len(keep)} of {len(demos)} SFT demonstrations whose "
                      f"prompt and answer are longer than the model's context of {context} tokens[/yellow]",
                      highlight=False)
    return keep


def limit_prompt_length(task, policy, data, console=None) -> tuple[set[str], int]:
    """``data.max_prompt_tokens``: the prompts of both splits over it are dropped (``data.long_prompts=skip``) or
    left-truncated (``truncate``: ``policy.max_prompt_tokens`` is set, so every later ``encode_prompt`` of training,
    held-out evaluation and the checks cuts them alike); one warning line says how many.

    Returns:
        (the texts of the train prompts truncated, how many train prompts were dropped).

    Raises:
        UserError: skipping leaves a split without prompts.
    """
    n, mode, counts = data.max_prompt_tokens, data.long_prompts, []
    cut: set[str] = set()
    dropped = 0
    for split, label in (("train", "train"), ("heldout", "held-out")):
        examples = getattr(task, split)
        ids = [policy.encode_prompt(e.prompt) for e in examples]
        keep, _, truncated = limit_prompts(ids, n, mode)
        if not keep:
            raise UserError(f"data.max_prompt_tokens={n}: none of the {len(examples)} {label} prompts fits (the "
                            f"shortest has {min(map(len, ids))} tokens); raise it, or set data.long_prompts=truncate")
        setattr(task, split, [examples[i] for i in keep])
        if split == "train":
            cut, dropped = {examples[i].prompt for i in truncated}, len(examples) - len(keep)
        counts.append(f"{len(examples) - len(keep) if mode == 'skip' else len(truncated)} of {len(examples)} {label}")
    if mode == "truncate":
        policy.max_prompt_tokens = n
    verb = "skipped" if mode == "skip" else f"kept the last {n} tokens of"
    if console is not None and any(not c.startswith("0 ") for c in counts):
        console.print(f"[yellow]data.max_prompt_tokens={n}: {verb} {' and '.join(counts)} prompts longer than "
                      f"{n} tokens (data.long_prompts={mode})[/yellow]", highlight=False)
    return cut, dropped


def prepare_run(cfg: Config, console=None):
    """Task, policy, reward pool: everything a run, SFT or eval needs from the config.

    Prompts are framed as ``data.chat_template`` and ``data.system_prompt`` say (``Policy.set_prompt_format``),
    limited to ``data.max_prompt_tokens`` (``limit_prompt_length``; ``task.long_prompts`` records what it did); those
    that do not fit the model's context with ``rollout.max_new_tokens`` are dropped (warned).
    With ``model.lora`` the policy gets LoRA adapters (``policy.lora.apply_lora``; only they train),
    naming the base directory (``model.path`` or the default base's cache folder) for checkpoints.
    Returns ``(task, policy, pool, source)``; ``source`` says where the policy came from.
    """
    task = configured_task(cfg)
    if not cfg.model.path:
        check_demonstrations(task, "the default base (warmed up on the data's answers)")
        questions_for_messages(task, None, console)  # before the default base learns them
    pool = reward_spec(cfg, task, heldout=True).pool()
    if cfg.model.path:
        policy, source = load_policy(cfg.model.path, revision=cfg.model.revision), cfg.model.path
        base = str(model_dir(cfg.model.path, cfg.model.revision).resolve())
    else:
        policy, path, how = load_default_base(task, task_key(cfg), cfg.model.model_dump(mode="json"), console)
        source, base = f"{path} ({how})", str(path)
    lo = cfg.model.lora
    try:
        policy.set_prompt_format(cfg.data.chat_template, cfg.data.system_prompt)
        questions_for_messages(task, policy, console)
        cut, skipped = limit_prompt_length(task, policy, cfg.data, console) if cfg.data.max_prompt_tokens else (set(), 0)
        skipped += fit_to_context(task, policy, cfg.rollout.max_new_tokens, console)
        if cfg.data.max_prompt_tokens:  # indices once the splits are final
            task.long_prompts = LongPrompts(frozenset(i for i, e in enumerate(task.train) if e.prompt in cut), skipped)
        if lo is not None:
            apply_lora(policy, r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules,
                       base=base, seed=cfg.model.seed)
    except BaseException:
        pool.close()
        raise
    if lo is not None:
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
        # the run's framing
        loaded.chat_template, loaded.system_prompt = policy.chat_template, policy.system_prompt
        loaded.text_as_is = policy.text_as_is
        loaded.max_prompt_tokens = policy.max_prompt_tokens
        return loaded
    saved, now = adapter_base(ckpt), policy.adapter.peft_config["default"].base_model_name_or_path
    if saved != now:
        raise UserError(f"the LoRA checkpoint {ckpt.name} was trained on base {saved!r} but this run's base is "
                        f"{now!r}; put the base back there (model.path, or TRUSTBATCH_CACHE for the default base)")
    restore_adapter(policy, loaded)
    return policy


def foreign_engine(cfg: Config, task, policy) -> Engine:
    """An engine on another model that shares the policy's tokenizer (``rollout.foreign_model``); never synced.

    It runs on the policy's device.

    Raises:
        UserError: the foreign model's tokenizer differs from the policy's; for an objective that needs the whole
            behaviour distribution (kl="exact"), its output vocabulary differs from the policy's.
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
        sizes = (other.get_output_embeddings().weight.shape[0], policy.model.get_output_embeddings().weight.shape[0])
        if sizes[0] != sizes[1] and source_spec(cfg).behaviour_models:
            raise UserError(f"rollout.foreign_model {spec!r} has {sizes[0]} output logits, the policy {sizes[1]}; the "
                            "exact KL compares whole distributions: use a foreign model of the policy's vocabulary "
                            "size or kl='k3'")
    other = other.to(next(policy.model.parameters()).device)
    return make_engine(_float32_spec(cfg), policy, model=other, version=NOT_THE_POLICY)


def _float32_spec(cfg: Config) -> EngineSpec:
    """A float32 transformers engine with the run's decoding loop and noise (``rollout.decode``, ``rollout.noise``),
    for the engines beside the rollout engine (held-out evaluation, a foreign model): a fast loop chosen for the
    rollouts serves them too. Under ``rollout.engine=vllm`` both keys keep their defaults (``check_engine``)."""
    return EngineSpec(decode=cfg.rollout.decode, noise=cfg.rollout.noise)


def reference_policy(cfg: Config, policy):
    """The frozen reference of the reference KL (``objective.options`` ref_kl_coef > 0) for the learner, or None.

    ``model.reference``: that directory's model (``load_policy``), which must share the policy's tokenizer. Else the
    policy as ``prepare_run`` loaded it, the initial policy, copied now (a resume calls this before the checkpoint's
    weights replace the policy's); under ``model.lora`` None: the learner runs the base with the adapters disabled
    (``Learner``'s ``reference=policy.adapter``), no copy. None too without a reference KL. On the policy's device.

    Raises:
        UserError: ``model.reference`` has another tokenizer or output vocabulary than the policy (or fails to load).
    """
    if not cfg.objective.options.get("ref_kl_coef"):
        return None
    if cfg.model.reference is None:
        return None if policy.adapter is not None else copy.deepcopy(policy.model)
    ref = load_policy(cfg.model.reference)
    sizes = (vocab_size(ref.model), vocab_size(policy.model))
    if ref.tokenizer.get_vocab() != policy.tokenizer.get_vocab() or sizes[0] != sizes[1]:
        raise UserError(f"model.reference={cfg.model.reference!r} has another tokenizer or vocabulary ({sizes[0]} "
                        f"output logits, the policy {sizes[1]}); the reference KL compares log-probs of the same "
                        "tokens: use a model of the policy's tokenizer")
    return ref.model.to(next(policy.model.parameters()).device)


@dataclass
class Built:
    parts: Parts
    eval_engine: Engine  # the learner's own float32 policy (or a whole copy of it), for held-out evaluation
    # under FSDP2, when the rollout engine holds another precision or older weights: fills the evaluation's whole
    # float32 copy before each evaluation (every rank pushes: the shards are gathered)
    eval_sync: CopySync | None = None


def build_parts(cfg: Config, task, policy, pool, *, foreign=None, world: World | None = None,
                version: int = 0, check_round=None, reference=None) -> Built:
    """The engine and its weight sync, the learner and the rollout source for ``policy`` at ``version``: the
    builders ``backends.backend_for(cfg)`` registers for the run's ``(rollout.mode, orchestrator)``. ``reference``:
    the reference KL's frozen model (``reference_policy``); None: the learner's default (a copy of the policy as
    the learner receives it; under LoRA its base).

    With ``train.strategy=fsdp2`` on several ranks the learner's module is sharded, so the engines
    sample from a whole copy taken before sharding (merged, under LoRA), which weight syncs refill with
    gathered tensors: a sharded module's forward waits on every rank, and ranks generate different lengths.

    Raises:
        UserError: what the pair, the learner or the source refuses (``backends``); a recorded behaviour
            distribution over its budget (``checks.check_recorded_behaviour``).
    """
    world = world or World()
    backend = backend_for(cfg)
    backend.check(cfg)
    check_recorded_behaviour(cfg, vocab_size(policy.model))
    sharded = cfg.train.strategy == "fsdp2" and world.size > 1
    whole = policy.model  # before the learner shards policy.model
    if sharded:
        whole = merged_copy(policy.model) if policy.adapter is not None else copy.deepcopy(policy.model)
    inputs = Inputs(cfg, task, policy, pool, world, version, engine=engine_spec(cfg), source=source_spec(cfg),
                    reward=reward_spec(cfg, task), whole=whole, sharded=sharded, foreign=foreign,
                    check_round=check_round, reference=reference)
    learner = backend.learner(inputs)
    # the held-out evaluation samples from the learner's own module (or its whole copy), as the learner computes
    eval_engine = make_engine(_float32_spec(cfg), policy, model=whole, autocast=learner_autocast(cfg))
    try:
        source, sync, eval_sync = backend.source(inputs, learner, eval_engine)
    except BaseException:
        learner.close()
        raise
    return Built(Parts(source, learner, sync), eval_engine, eval_sync)
