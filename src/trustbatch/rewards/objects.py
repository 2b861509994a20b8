"""Reward functions given as Python objects (``trustbatch.api.Trainer(reward_funcs=[...])``) instead of names.

A function Python can import by its name (a module-level function of an importable module) becomes
``module:function`` (``reward_name``) and runs wherever a named scorer runs: reward worker processes with their time
limit, rollout workers, Ray, a resume from the command line. Any other callable (a closure, a lambda, a bound method,
an object with ``__call__``) is kept here under ``python:QUALNAME``: it exists only in this process, so it is scored
in the trainer's process with no time limit (``RewardPool`` gives it no workers), and a run that would need it in
another process (async rollout workers, Ray) is refused (``in_other_processes``).

TRL's batch form (a ``completions`` parameter) given as an object is called once per group, the completions of one
prompt together (``GroupForm``), so a reward may compare them (rank within the group); a named batch-form function
keeps ``scorers.BatchForm``'s one-completion calls, which the worker pool can time and count one by one.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

from ..errors import UserError
from .scorers import GROUP_KEY, Scorer, ScoreResult, is_score, one_line, takes_batch

PREFIX = "python:"
_OBJECTS: dict[str, Callable] = {}


def reward_name(fn: Callable | str) -> str:
    """The scorer name for ``fn``: a string as it is, ``module:function`` where Python imports ``fn`` by that name,
    else ``python:QUALNAME`` (``#k`` added for a second object of the same name), registered in this process.

    Raises:
        UserError: ``fn`` is neither a string nor callable.
    """
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise UserError(f"reward function {one_line(repr(fn), 60)} is not callable; pass a function or a scorer name")
    named = _importable_name(fn)
    if named:
        return named
    base = _object_name(fn)
    name, k = base, 1
    while _OBJECTS.get(name, fn) is not fn:
        name, k = f"{base}#{k}", k + 1
    _OBJECTS[name] = fn
    return name


def register_again(fns: list, saved: list[str]) -> None:
    """For a resume: the Python-object rewards among ``fns`` (if any) take the run's ``python:`` names ``saved`` (its
    config's, in order), replacing whatever this process registered under them (a notebook that redefined the
    function would otherwise resume with the old one, the new one going to ``NAME#1``).

    Raises:
        UserError: a count or a name that does not match the run's.
    """
    objs = [f for f in fns if not isinstance(f, str) and callable(f) and _importable_name(f) is None]
    wanted = [n for n in saved if is_object(n)]
    if not objs:  # none given: the run looks them up by name (one line if this process has none)
        return
    if len(objs) != len(wanted):
        raise UserError(f"the run was trained with {len(wanted)} Python-object rewards {wanted}, and {len(objs)} are "
                        "given; give the same callables, in the same order, as reward_funcs")
    for fn, name in zip(objs, wanted):
        own = _object_name(fn)
        if name.split("#")[0] != own:
            raise UserError(f"the run's reward {name!r} is given {own!r}; give the same callables, in the same "
                            "order, as reward_funcs")
        _OBJECTS[name] = fn


def _object_name(fn: Callable) -> str:
    """``python:QUALNAME`` of a callable object, before any ``#k`` that tells apart two of one name."""
    return PREFIX + (getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def _importable_name(fn: Callable) -> str | None:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not mod or not qual or mod == "__main__" or not qual.isidentifier():  # "<locals>", "<lambda>", "A.method"
        return None
    try:
        found = getattr(importlib.import_module(mod), qual, None)
    except Exception:  # noqa: BLE001 - not importable by name is all this asks
        return None
    return f"{mod}:{qual}" if found is fn else None


def is_object(name: str) -> bool:
    """Whether ``name`` names a Python object registered by ``reward_name`` (``python:...``)."""
    return isinstance(name, str) and name.startswith(PREFIX)


def lookup(name: str) -> Scorer | "GroupForm":
    """The scorer registered as ``name``: the object itself, or a ``GroupForm`` of a batch-form one.

    Raises:
        UserError: no object of that name in this process (a resume or another process without the object).
    """
    fn = _OBJECTS.get(name)
    if fn is None:
        raise UserError(f"reward {name!r} was a Python object given to trustbatch.api.Trainer and exists only in the "
                        "process that gave it; give it again (Trainer(reward_funcs=...), for a resume too), or make it "
                        "a module-level function named as module:function")
    return GroupForm(fn) if takes_batch(fn) else fn


def in_other_processes(names: list[str], where: str) -> None:
    """Refuse Python-object rewards for a run that scores in other processes (``where`` names the setting).

    Raises:
        UserError: one of ``names`` is a ``python:`` object.
    """
    objs = [n for n in names if is_object(n)]
    if objs:
        raise UserError(f"reward {objs[0]!r} is a Python object, which {where} cannot reach (it lives in this "
                        "process); make it a module-level function of an importable module, or drop that setting")


class GroupForm:
    """A batch-form reward ``f(prompts, completions, **columns) -> list`` called once per group of completions.

    A group is a run of consecutive completions with the same ``GROUP_KEY`` in their contexts (the rollout source
    numbers a round's groups: one prompt drawn twice in a row is two groups), or, without one, the same prompt.
    ``f`` gets that group's prompts, completions, ``reference`` (gold answers) and each data column as lists of the
    group's length. A raise, a list of the wrong length, or a value that is not a score fails the whole
    group (reward 0, counted per completion); ``None`` scores 0 (TRL's "does not apply"); a finite score outside
    [0, 1] is clamped and counted, as for every scorer.
    """

    def __init__(self, fn: Callable):
        self.fn = fn

    def score(self, completions: list[str], references: list[str], contexts: list[dict] | None) -> ScoreResult:
        """Rewards in order for ``completions`` (``contexts[i]`` = ``{"prompt": ..., **columns}``, or None)."""
        ctx = contexts or [{"prompt": ""} for _ in completions]
        group = [c.get(GROUP_KEY, ("prompt", c.get("prompt"))) for c in ctx]
        res = ScoreResult([], 0, 0)
        start = 0
        while start < len(completions):
            end = start + 1
            while end < len(completions) and group[end] == group[start]:
                end += 1
            self._group(res, completions[start:end], references[start:end], ctx[start:end])
            start = end
        return res

    def _group(self, res: ScoreResult, completions: list[str], references: list[str], ctx: list[dict]) -> None:
        cols = {k: [c.get(k) for c in ctx] for k in ctx[0]
                if k not in ("prompt", "prompts", "completions", "reference", GROUP_KEY)}
        try:
            out = self.fn(prompts=[c.get("prompt", "") for c in ctx], completions=completions, reference=references,
                          **cols)
            if not isinstance(out, (list, tuple)) or len(out) != len(completions):
                raise ValueError(f"returned {type(out).__name__} {one_line(repr(out), 60)} for {len(completions)} "
                                 "completions; return one score per completion")
            bad = next((v for v in out if v is not None and not (is_score(v) and math.isfinite(float(v)))), None)
            if bad is not None:
                raise ValueError(f"returned {type(bad).__name__} {bad!r}, not a finite number")
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a reward's bug is counted, as for every scorer
            res.rewards += [0.0] * len(completions)
            res.errors += len(completions)
            res.last_error = one_line(f"{type(e).__name__}: {e}")
            return
        for v in out:
            v = 0.0 if v is None else float(v)
            res.clamped += not 0.0 <= v <= 1.0
            res.rewards.append(min(1.0, max(0.0, v)))
