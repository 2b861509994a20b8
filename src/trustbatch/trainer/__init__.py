"""The learner and the training loops."""

from .learner import Learner, TrainBatch

__all__ = ["Learner", "TrainBatch"]
