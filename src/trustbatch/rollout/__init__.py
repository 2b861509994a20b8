"""Rollout engines: the behaviour policy that samples completions and records their log-probs."""

from .engine import NOT_THE_POLICY, Engine, Rollout, SamplingParams
from .transformers_engine import TransformersEngine

__all__ = ["NOT_THE_POLICY", "Engine", "Rollout", "SamplingParams", "TransformersEngine"]
