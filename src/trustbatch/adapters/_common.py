"""What both adapters share: the import guard, the objective check and the metric names."""

from __future__ import annotations

import importlib
from types import ModuleType

from .. import objectives
from ..errors import UserError

METRIC_PREFIX = "trustbatch/"


def import_stack(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise a UserError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"{module} is not importable ({e}); install it with `pip install trustbatch[{extra}]`") from None


def check_objective(name: str, options: dict | None, *, stack: str, fixed: dict[str, str]) -> dict:
    """Check that objective ``name`` can run inside ``stack`` with the user's ``options``; return them checked.

    ``fixed`` maps options the stack decides (e.g. ``aggregation``) to the stack setting that does.

    Raises:
        UserError: an unknown objective, one that needs a proximal snapshot (the stacks hand the loss
            no π_θ snapshot of their own), an option the stack decides, or an option
            ``objectives.validate_options`` refuses (full distributions, per-token tensors included).
    """
    try:
        s = objectives.spec(name)
    except ValueError as e:
        raise UserError(str(e)) from None
    if s.needs_proximal:
        usable = [n for n in objectives.names() if not objectives.spec(n).needs_proximal]
        raise UserError(f"objective {name!r} needs a proximal π_θ snapshot, which {stack} does not hand its loss; "
                        f"use one of {usable}")
    options = dict(options or {})
    for key, where in fixed.items():
        if key in options:
            raise UserError(f"objective {name!r}: option {key!r} is decided by {stack} ({where}); remove it")
    try:
        return objectives.validate_options(name, options)
    except ValueError as e:
        raise UserError(f"{stack}: {e}") from None


def usable_objectives() -> list[str]:
    """Registered objectives that both adapters can run (no proximal snapshot needed)."""
    return [n for n in objectives.names() if not objectives.spec(n).needs_proximal]


def ess_kwargs(name: str, scope: str) -> dict:
    """The ``ess_scope=`` keyword for objectives that take one (P3O); nothing for the others."""
    return {"ess_scope": scope} if "ess" in objectives.spec(name).batch_stats and len(objectives.spec(name).ess_scopes) > 1 else {}


def default_aggregation(name: str) -> str:
    """The aggregation objective ``name`` uses when none is given, as its registry spec declares it (gspo's keyword
    default is the sequence mean, after its paper; the common default is the token mean)."""
    return objectives.spec(name).default("aggregation")
