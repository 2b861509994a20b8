"""Which keyword a model's forward (and ``generate``) takes its key/value cache by, and where its output puts it.

transformers 5.24 renamed the cache argument and output field from ``past_key_values`` to ``cache``
(``@deprecate_kwarg("past_key_values", new_name="cache")`` on ``generate`` and the model forwards;
``CausalLMOutputWithPast.cache``). The old name still works there with a deprecation warning, but
a model's signature and output no longer show it, so code keyed on the old name silently took its
no-cache fallback. These helpers read the name from the model itself, so one code path serves
transformers before and after the rename, and a custom model with either name.

``GrowingCache`` is a ``DynamicCache`` whose layers append into buffers with spare room instead of
concatenating: ``DynamicLayer.update`` copies the whole cache at every decoded token (``torch.cat``),
which for the lab's 512-row batches of a 0.9M-parameter model was ~12% of a run.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

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


_LAZY_INIT_ARGS = len(inspect.signature(DynamicLayer.lazy_initialization).parameters) - 1  # less self


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes new keys and values into buffers with room to spare.

    ``keys`` and ``values`` are views [B, H, n, D] of the first n positions of buffers
    [B, H, capacity, D]; a token is one copy of its own keys and values, not of the whole cache.
    A full buffer is replaced by one twice the size needed (amortized O(1) copies per token).
    Attention reads the same numbers in the same order, so outputs equal ``DynamicLayer``'s bit for
    bit (``tests/unit/test_kv_cache.py``). Whatever replaces ``keys`` with a new tensor
    (``batch_select_indices``, ``reorder_cache``) is noticed, and the next update starts new buffers.
    Run on CPU only; untested on a GPU (none was available), where attention kernels may require
    contiguous keys and copy the view.
    """

    def __init__(self, reserve: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.reserve = reserve  # positions to allocate at the first update (e.g. prompt + max new tokens)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _owns_keys(self) -> bool:
        k, b = self.keys, self._kbuf
        return (b is not None and k is not None and k.data_ptr() == b.data_ptr() and k.shape[:-2] == b.shape[:-2]
                and k.stride() == b.stride())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            # transformers < 5 takes the keys alone here, later versions keys and values
            self.lazy_initialization(*(key_states, value_states)[:_LAZY_INIT_ARGS])
        n, add = self.get_seq_length(), key_states.shape[-2]
        if n == 0 or not self._owns_keys() or n + add > self._kbuf.shape[-2]:
            cap = self.reserve if self.reserve >= n + add else 2 * (n + add)
            kbuf, vbuf = (x.new_empty((*x.shape[:-2], cap, x.shape[-1])) for x in (key_states, value_states))
            if n:
                kbuf[..., :n, :].copy_(self.keys)
                vbuf[..., :n, :].copy_(self.values)
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[..., n:n + add, :].copy_(key_states)
        self._vbuf[..., n:n + add, :].copy_(value_states)
        self.keys = self._kbuf[..., :n + add, :]
        self.values = self._vbuf[..., :n + add, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of ``GrowingLayer``s: one per decoder layer, made at its first update.

    ``reserve`` is the number of positions each layer allocates at once (prompt width plus new
    tokens spares every later reallocation). Only for models whose layers all attend to the full
    sequence: see ``growing_cache_fits``.
    """

    def __init__(self, reserve: int = 0):
        Cache.__init__(self, layer_class_to_replicate=functools.partial(GrowingLayer, reserve))


def growing_cache_fits(model: torch.nn.Module) -> bool:
    """Whether ``GrowingCache`` may stand in for the cache ``generate`` would build for ``model``.

    True when the model takes a cache argument, is decoder-only, and the ``DynamicCache`` transformers
    builds from its config has only plain ``DynamicLayer``s: no sliding-window, chunked,
    linear-attention or shared layers, whose caches differ from ours. False, too, when the config
    cannot be read that way (e.g. a per-layer heterogeneous config). A ``cache_implementation`` in the
    model's generation config does not count: the rollout engine calls ``generate`` without it.
    """
    if cache_kwarg(model) is None or not hasattr(model, "config"):
        return False
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return False
    try:
        layers = DynamicCache(config=cfg).layers
    except Exception:  # configs transformers cannot build a cache from; generate's own cache serves them
        return False
    return all(type(layer) is DynamicLayer for layer in layers)
