"""Reward functions given as Python objects (``trustbatch.api.Trainer(reward_funcs=[...])``) instead of names.

A function Python can import by its name (a module-level function of an importable module) becomes
``module:function`` (``reward_name``) and runs wherever a named scorer runs: reward worker processes with their time
limit, rollout workers, Ray, a resume from the command line. Any other callable (a closure, a lambda, a bound method,
an object with ``__call__``) is kept here under ``python:QUALNAME``: it exists only in this process, so it is scored
in the trainer's process with no time limit (``RewardPool`` gives it no workers), and a run that would need it in
another process (async rollout workers, Ray) is refused (``in_other_processes``).

TRL's batch form (a ``completions`` parameter) is called once per group, the completions of one prompt together
(``scorers.BatchForm``), so a reward may compare them (rank within the group), whether given as an object or by name.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from ..errors import UserError
from .scorers import BatchForm, Scorer, one_line, takes_batch

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
        # before 7a1ea6d a partial was "python:partial" and an instance its class's qualname, in saved runs too
        legacy = PREFIX + (getattr(fn, "__qualname__", None) or type(fn).__qualname__)
        if name.split("#")[0] not in (own, legacy):
            raise UserError(f"the run's reward {name!r} is given {own!r}; give the same callables, in the same "
                            "order, as reward_funcs")
        _OBJECTS[name] = fn


def _object_name(fn: Callable) -> str:
    """``python:QUALNAME`` of a callable object, before any ``#k`` that tells apart two of one name: a
    ``functools.partial``'s function's, an instance's own ``__name__`` where it has one (TRL's reward classes set it
    to keep their metric names), else its class's; the metric label is its last component, as TRL's
    ``get_callable_name`` names a reward function."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return PREFIX + (getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__)


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


def lookup(name: str) -> Scorer | BatchForm:
    """The scorer registered as ``name``: the object itself, or a ``BatchForm`` of a batch-form one.

    Raises:
        UserError: no object of that name in this process (a resume or another process without the object).
    """
    fn = _OBJECTS.get(name)
    if fn is None:
        raise UserError(f"reward {name!r} was a Python object given to trustbatch.api.Trainer and exists only in the "
                        "process that gave it; give it again (Trainer(reward_funcs=...), for a resume too), or make it "
                        "a module-level function named as module:function")
    return BatchForm(fn) if takes_batch(fn) else fn


def in_other_processes(names: list[str], where: str) -> None:
    """Refuse Python-object rewards for a run that scores in other processes (``where`` names the setting).

    Raises:
        UserError: one of ``names`` is a ``python:`` object.
    """
    objs = [n for n in names if is_object(n)]
    if objs:
        raise UserError(f"reward {objs[0]!r} is a Python object, which {where} cannot reach (it lives in this "
                        "process); make it a module-level function of an importable module, or drop that setting")
