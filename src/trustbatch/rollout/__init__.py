"""Rollout engines: the behaviour policy that samples completions and records their log-probs."""

from .engine import NOT_THE_POLICY, Engine, Rollout, SamplingParams
from .spec import EngineSpec, behaviour_distribution, check_engine, make_engine, shares_module
from .transformers_engine import TransformersEngine

__all__ = ["NOT_THE_POLICY", "Engine", "EngineSpec", "Rollout", "SamplingParams", "TransformersEngine",
           "behaviour_distribution", "check_engine", "make_engine", "shares_module"]
