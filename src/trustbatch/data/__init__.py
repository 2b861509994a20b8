"""Prompt sources. An ``Example`` is a prompt, a reference answer for the scorer, and a scorer name."""

from .tasks import Example, TaskSplit, load_task

__all__ = ["Example", "TaskSplit", "load_task"]
