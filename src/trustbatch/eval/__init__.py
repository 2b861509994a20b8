"""Evaluation: the unbiased pass@k estimator and held-out accuracy with the training engines."""

from .heldout import evaluate_heldout
from .passk import pass_at_k

__all__ = ["evaluate_heldout", "pass_at_k"]
