"""Checks of a configuration that need no model or data (``recipes.build.preflight`` runs them first)."""

from __future__ import annotations

from .. import objectives
from ..config import Config
from ..errors import UserError
from .backends import backend_for


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
    """Refuse LoRA under FSDP2: the merged weights an engine, an evaluation copy and a checkpoint take are computed
    from whole tensors (``policy.lora.merged_state_dict``), which FSDP2 holds as DTensor shards.

    Raises:
        UserError: ``model.lora`` with ``train.strategy=fsdp2``.
    """
    if cfg.model.lora is not None and cfg.train.strategy == "fsdp2":
        raise UserError("model.lora does not run with train.strategy=fsdp2 (the sharded adapters are not merged "
                        "for the rollout engine or the checkpoint); use train.strategy=ddp, which replicates only "
                        "the small adapters' optimizer state, or drop model.lora")
