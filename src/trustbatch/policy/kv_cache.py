"""Which keyword a model's forward (and ``generate``) takes its key/value cache by, and where its output puts it.

transformers 5.24 renamed the cache argument and output field from ``past_key_values`` to ``cache``
(``@deprecate_kwarg("past_key_values", new_name="cache")`` on ``generate`` and the model forwards;
``CausalLMOutputWithPast.cache``). The old name still works there with a deprecation warning, but
a model's signature and output no longer show it, so code keyed on the old name silently took its
no-cache fallback. These helpers read the name from the model itself, so one code path serves
transformers before and after the rename, and a custom model with either name.
"""

from __future__ import annotations

import inspect

import torch

NAMES = ("cache", "past_key_values")  # the current name first


def cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name ``model.forward`` takes a key/value cache by ("cache" or "past_key_values"), or None if neither.

    Reads the signature that ``functools.wraps`` decorators expose (transformers' ``deprecate_kwarg``
    keeps the new name there). None also when the signature cannot be read.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return cache_name(params)


def cache_name(params) -> str | None:
    """``cache_kwarg`` for a signature's parameters already read (a mapping or set of names)."""
    return next((n for n in NAMES if n in params), None)


def output_cache(out):
    """The key/value cache a forward returned: ``out.cache`` (transformers >= 5.24) or ``out.past_key_values``.

    None when the output carries neither (e.g. ``use_cache=False``, or a model without a cache).
    """
    for name in NAMES:
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None
