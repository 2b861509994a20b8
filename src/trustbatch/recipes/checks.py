"""Checks of a configuration that need no model or data (``recipes.build.preflight`` runs them first)."""

from __future__ import annotations

from pathlib import Path

from .. import objectives
from ..config import Config
from ..config.sections import set_unread
from ..errors import UserError
from ..policy.budget import LOGITS_BYTES, held_copies, recorded_bytes, recorded_fits
from ..policy.reward_model import check_reward_model
from ..rewards.scorers import MODEL_PREFIX, is_model
from ..rollout.spec import KL_DISTRIBUTIONS, EngineSpec, behaviour_distribution
from .backends import WORKERS_SEND, backend_for


def check_objective(cfg: Config) -> None:
    """Fail before any work when the objective's options or ESS scope are invalid, or need the behaviour policy's
    whole distribution (kl="exact") where the run cannot give it (``_exact_kl_refusal``). What an engine gives is read
    from its declaration (``rollout.spec.behaviour_distribution``): ``full`` or ``recorded`` (the KL), ``top_k`` (its
    top-k lower bound; not for a two-anchor mixture), ``none`` (refused). How π_b reaches the learner is the rollout
    backend's (``backends.Backend.behaviour``): ``full`` (the engine's module, in the learner's process) or
    ``rebuilt`` (rollout workers: the learner rebuilds each batch's behaviour from the weights it pushed, faithful
    only for an engine that declares ``full``; an engine that declares ``top_k`` sends its top-k log-probs with
    each batch, ``backends.WORKERS_SEND``; neither for Ray learner actors). Also refused: top-p < 1, two
    anchors under FSDP2, and ``rollout.logprobs_top_k`` set where nothing reads it.

    Raises:
        UserError: one line naming the option and the fix.
    """
    try:
        # supplied: the learner rebuilds the behaviour's full log-probs (where the run cannot, refused below), runs the
        # reference policy and takes the entropy from its LM head
        objectives.validate_options(cfg.objective.name, cfg.objective.options, supplied=objectives.LEARNER_SUPPLIED)
        spec = objectives.spec(cfg.objective.name)
    except ValueError as e:
        raise UserError(f"invalid objective.options for {cfg.objective.name!r}: {e}") from None
    if spec.batch_stats and cfg.train.ess_scope not in spec.ess_scopes:
        raise UserError(f"objective {cfg.objective.name!r} supports train.ess_scope in {spec.ess_scopes}, "
                        f"not {cfg.train.ess_scope!r}")
    if not spec.batch_stats and set_unread(cfg.train, "ess_scope"):
        raise UserError(f"train.ess_scope={cfg.train.ess_scope} is read only by an objective that measures the ESS "
                        f"(p3o), not {cfg.objective.name!r}; drop train.ess_scope")
    cause = spec.full_logprobs_cause(cfg.objective.options)
    ro = cfg.rollout
    engine = behaviour_distribution(EngineSpec(name=ro.engine, precision=ro.precision))
    top_k_default = type(ro).model_fields["logprobs_top_k"].default
    if ro.logprobs_top_k != top_k_default and (cause is None or engine != "top_k"):
        raise UserError(f"rollout.logprobs_top_k={ro.logprobs_top_k} is read only with objective kl=exact on an engine "
                        "that returns top-k log-probs (rollout.engine=vllm); drop it")
    if cause is not None:
        why = _exact_kl_refusal(cfg, engine, spec.needs_proximal)
        if why is not None:
            raise UserError(f"objective.options {cause} needs the behaviour policy's full log-probs: {why}, "
                            f"or use kl='k3'")


def _exact_kl_refusal(cfg: Config, engine: str, needs_proximal: bool) -> str | None:
    """Why the run cannot give the learner π_b for the exact KL (a clause of ``check_objective``'s line), or None.
    ``engine``: what the engine declares it returns (``rollout.spec.behaviour_distribution``)."""
    ro = cfg.rollout
    backend = backend_for(cfg).behaviour
    if engine not in KL_DISTRIBUTIONS:
        return (f"rollout.engine={ro.engine} returns {engine} of its sampling distribution beyond the sampled tokens "
                "(neither the whole distribution nor its top-k log-probs); use rollout.engine=transformers")
    if ro.top_p < 1.0:
        return (f"top-p sampling (rollout.top_p={ro.top_p:g}) gives π_b = 0 outside the nucleus, where KL(π_θ‖π_b) is "
                "infinite; set rollout.top_p=1.0")
    if backend not in ("full", "rebuilt"):
        return f"rollout.mode={ro.mode} cannot hand the learner the behaviour model ({backend}); use rollout.mode=sync"
    if backend == "rebuilt" and engine not in ("full", *WORKERS_SEND):
        return (f"rollout.mode={ro.mode} rebuilds each batch's behaviour from the weights the learner pushed, which "
                f"teacher forcing reproduces only where the engine declares full (rollout.engine={ro.engine} at "
                f"rollout.precision={ro.precision} declares {engine}, which its workers do not send; they send "
                "only top-k log-probs); use rollout.precision=float32 on rollout.engine=transformers, "
                "rollout.engine=vllm, or rollout.mode=sync")
    if backend == "rebuilt" and cfg.orchestrator == "ray" and cfg.ray_learners > 0:
        return (f"Ray learner actors (ray_learners={cfg.ray_learners}) are not handed the rebuilt behaviour models "
                "(nor run on the workers' top-k log-probs yet); set ray_learners=0 (the learner in the driver)")
    if engine == "top_k" and needs_proximal:
        return (f"rollout.engine={ro.engine} returns top-k log-probs, whose lower bound does not carry over to the "
                f"mixture π_mix of {cfg.objective.name}; use objective.name=p3o or rollout.engine=transformers")
    if needs_proximal and cfg.train.strategy == "fsdp2":
        return "the proximal model would be the FSDP2-sharded module itself; use train.strategy=ddp"
    return None


def check_recorded_behaviour(cfg: Config, vocab: int, budget_bytes: int = LOGITS_BYTES) -> None:
    """Fail at start when the exact KL needs the behaviour distribution recorded at sampling (an engine that declares
    ``recorded`` at ``rollout.precision``: teacher forcing would rebuild another distribution) and one round's
    record, N = prompts_per_step · group_size rows × max_new_tokens steps × ``vocab`` float32, held twice at its
    peak (three times packed or with foreign rows: ``policy.budget.held_copies``), passes ``budget_bytes``
    (``policy.budget.recorded_fits``; default ``LOGITS_BYTES``, 256 MiB). Needs V, so it runs
    once the policy is loaded (``recipes.build.build_parts``), before any rollout.

    Raises:
        UserError: one line naming the precision, the size and the fixes (float32 rollouts or kl='k3').
    """
    spec = objectives.spec(cfg.objective.name)
    cause = spec.full_logprobs_cause(cfg.objective.options)
    ro = cfg.rollout
    if cause is None or behaviour_distribution(EngineSpec(name=ro.engine, precision=ro.precision)) != "recorded":
        return
    rows, steps = ro.prompts_per_step * ro.group_size, ro.max_new_tokens
    copies = held_copies(cfg.train.padding_free, ro.foreign_fraction > 0)
    held = "twice" if copies == 2 else "three times"
    if not recorded_fits(rows, steps, vocab, budget_bytes, copies):
        raise UserError(f"objective.options {cause} with rollout.precision={ro.precision} needs the behaviour "
                        f"distribution recorded at sampling (teacher forcing does not rebuild it at that precision), "
                        f"which at V={vocab} takes {rows} rows x {steps} steps x V x 4 bytes = "
                        f"{recorded_bytes(rows, steps, vocab) / 2**20:.0f} MiB per round, held {held} at its peak: "
                        f"over the {budget_bytes / 2**20:.0f} MiB budget; use rollout.precision=float32 or kl='k3'")


def check_shaping(cfg: Config) -> None:
    """DAPO's overlong zone lies inside the completion budget: ``rollout.overlong_cache`` ≤ ``rollout.max_new_tokens``
    (as resolved: the budget a data file's benchmark sets counts, ``defaults.with_answer_budget``).

    Raises:
        UserError: a zone longer than the budget (``advantages.overlong_penalty`` would fail in round 1).
    """
    ro = cfg.rollout
    if ro.overlong_cache is not None and ro.overlong_cache > ro.max_new_tokens:
        raise UserError(f"rollout.overlong_cache={ro.overlong_cache} is longer than the completion budget "
                        f"rollout.max_new_tokens={ro.max_new_tokens} (the penalty zone is its last tokens); lower "
                        "rollout.overlong_cache, or raise rollout.max_new_tokens")


def check_orchestrator(cfg: Config) -> None:
    """What the ``(rollout.mode, orchestrator)`` pair refuses (``backends.BACKENDS``): ``orchestrator=ray`` runs the
    async rollout workers as Ray actors, so it needs that mode and Ray.

    Raises:
        UserError: ``orchestrator=ray`` with ``rollout.mode=sync``, or without Ray installed (names the extra), or
            an address that does not answer (``orchestration.ray_cluster.check_ray``), or Ray learners with
            ``train.strategy=fsdp2``.
    """
    backend_for(cfg).check(cfg)


def check_learner(cfg: Config) -> None:
    """Refuse what the reference KL's frozen reference cannot be: ``model.reference`` without a reference KL (it
    would be ignored) or not a local model directory; a reference KL with Ray learner actors (they build the policy
    alone, from named tensors, and hold no reference).

    Raises:
        UserError: ``model.reference`` without ``ref_kl_coef`` > 0 or without a config.json; ``ref_kl_coef`` > 0
            with ``orchestrator=ray`` and ``ray_learners`` > 0.
    """
    ref_kl = bool(cfg.objective.options.get("ref_kl_coef"))
    ref = cfg.model.reference
    if ref is not None and not ref_kl:
        raise UserError("model.reference is the reference KL's model, and objective.options sets no ref_kl_coef > 0; "
                        "set one (e.g. 'objective.options={ref_kl_coef: 0.04}') or drop model.reference")
    if ref is not None and not (Path(ref) / "config.json").is_file():
        raise UserError(f"model.reference={ref!r} is not a local Hugging Face model directory (no config.json); give "
                        "one with the policy's tokenizer")
    if ref_kl and cfg.orchestrator == "ray" and cfg.ray_learners > 0:
        raise UserError("objective.options ref_kl_coef does not run with Ray learner actors (ray_learners) yet: they "
                        "hold no reference policy; set ray_learners=0")


def check_reward(cfg: Config) -> None:
    """Refuse ``eval.reward=functions`` without a reward function (``reward.name`` or a ``reward.functions`` term that
    is no reward model); refuse a reward model (``reward.model``, or an ``rm:`` term of ``reward.functions``) that is no
    sequence-classification model with one label (``policy.reward_model.check_reward_model``, its config alone), or
    that the run would need in rollout worker processes (``rollout.mode=async``, ``orchestrator=ray``): it runs in
    the trainer's process beside the learner, as ``rewards.objects`` keeps Python objects there.

    Raises:
        UserError: one line naming the cause and the fix.
    """
    rw = cfg.reward
    models = ([rw.model] if rw.model is not None else []) + [f.name for f in rw.functions if is_model(f.name)]
    if cfg.eval.reward == "functions" and not (rw.name or any(not is_model(f.name) for f in rw.functions)):
        raise UserError("eval.reward=functions scores held-out evaluation by the training reward's functions, and this "
                        "run has none (a reward model scores training alone); give reward.functions, or drop "
                        "eval.reward")
    if not models:
        return
    if cfg.rollout.mode == "async" or cfg.orchestrator == "ray":
        where = "orchestrator=ray" if cfg.orchestrator == "ray" else "rollout.mode=async"
        raise UserError(f"reward model {models[0]!r} runs in the trainer's process on the learner's device, which the "
                        f"rollout workers of {where} cannot reach; use rollout.mode=sync with reward.model")
    for m in models:
        check_reward_model(m.removeprefix(MODEL_PREFIX))
