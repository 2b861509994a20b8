"""YAML's boolean words (``on``, ``off``, ``yes``, ``no``, ``true``, ``false``; ``yaml_io.YamlBool``) given to the
config field they are for: the boolean to a boolean key, the word to a key whose values are words
(``data.chat_template=on``), so that a refusal quotes what the user typed, not ``True``."""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from .yaml_io import YamlBool


def switch(v: Any) -> Any:
    """A key of words ``auto``/``on``/``off`` (``data.chat_template``): a boolean, or the word ``true``/``false``
    (any case), as ``on``/``off``; anything else unchanged, for the field to accept or refuse."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, str) and v.lower() in ("on", "off", "true", "false"):
        return "on" if v.lower() in ("on", "true") else "off"
    return v


def _leaves(annotation) -> set:
    """The plain types an annotation admits (a Literal's: its values' types; ``Annotated`` and unions unwrapped)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {type(a) for a in get_args(annotation)}
    if origin is Annotated:
        return _leaves(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_leaves(a) for a in get_args(annotation)))
    return {annotation}


def all_bools(v: Any) -> Any:
    """``v`` with every ``YamlBool`` in it (nested dicts and lists too) as YAML's boolean: free-form values."""
    if isinstance(v, YamlBool):
        return v.value
    if isinstance(v, dict):
        return {k: all_bools(x) for k, x in v.items()}
    return [all_bools(x) for x in v] if isinstance(v, list) else v


def typed(v: Any, annotation) -> Any:
    """A value read with ``YamlBool``s as the field of ``annotation`` takes it: a boolean field gets YAML's boolean,
    a number field the ``YamlBool`` (``sections._no_bool`` refuses it, quoting it), any other the word as typed.
    Free-form dicts get booleans throughout; a section's own fields are its own validator's (``_Strict``)."""
    leaves = _leaves(annotation)
    if isinstance(v, YamlBool):
        if bool in leaves:
            return v.value
        return v if leaves <= {int, float, type(None)} else str(v)
    if isinstance(v, list):
        return [str(x) if isinstance(x, YamlBool) else x for x in v]
    if isinstance(v, dict) and any(get_origin(a) is dict for a in leaves):
        return all_bools(v)
    return v
