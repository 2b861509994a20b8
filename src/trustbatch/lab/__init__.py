"""The off-policy lab: experiments (arms × seeds of ``trustbatch train``), a parallel resumable runner, a report."""

from .experiment import Experiment, load_experiment
from .runner import run_experiment

__all__ = ["Experiment", "load_experiment", "run_experiment"]
