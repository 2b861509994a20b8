"""Recipes: build the parts of a run from a ``Config`` (``build``) and run them (``train``); evaluate a model on
benchmarks (``evaluate``, from plain arguments).

The only modules below the CLI that read the configuration; the CLI and the lab call them.
"""

from .build import configured_task, prepare_run, task_key
from .train import train

__all__ = ["configured_task", "prepare_run", "task_key", "train"]
