"""Checks of a configuration that need no model or data (``recipes.build.preflight`` runs them first)."""

from __future__ import annotations

from .. import objectives
from ..config import Config
from ..errors import UserError
from ..rollout.spec import EngineSpec, behaviour_distribution
from .backends import backend_for


def check_objective(cfg: Config) -> None:
    """Fail before any work when the objective's options or ESS scope are invalid, or need the behaviour policy's
    whole distribution (kl="exact") where the run cannot give it: an engine or rollout backend that does not
    declare ``full`` (``rollout.spec.behaviour_distribution``, ``backends.Backend.behaviour``), top-p < 1.

    Raises:
        UserError: one line naming the option and the fix.
    """
    try:
        # supplied: the learner rebuilds the behaviour's full log-probs; where the run cannot, refused below
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
        engine = behaviour_distribution(EngineSpec(name=ro.engine))
        backend = backend_for(cfg).behaviour
        why = (f"rollout.engine={ro.engine} returns {engine} behaviour log-probs, not the whole distribution "
               "(the top-k lower bound is not wired to training yet); use rollout.engine=transformers"
               if engine != "full" else
               f"top-p sampling (rollout.top_p={ro.top_p:g}) gives π_b = 0 outside the nucleus, where KL(π_θ‖π_b) is "
               "infinite; set rollout.top_p=1.0" if ro.top_p < 1.0 else
               f"rollout.mode={ro.mode} cannot hand the learner the behaviour model ({backend}); use rollout.mode=sync"
               if backend != "full" else
               "the proximal model would be the FSDP2-sharded module itself; use train.strategy=ddp"
               if spec.needs_proximal and cfg.train.strategy == "fsdp2" else None)
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

