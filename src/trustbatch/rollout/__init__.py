"""Rollout engines: the behaviour policy that samples completions and records their log-probs."""

from .engine import Rollout, RolloutEngine
from .transformers_engine import TransformersEngine

__all__ = ["Rollout", "RolloutEngine", "TransformersEngine"]
