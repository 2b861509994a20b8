"""Seeds derived from integers, the same in every process, for random streams that must not depend on who draws them.

A completion's Gumbel stream, a refill's prompt order and the evaluation stream of a round are each seeded by
``row_seed`` of the integers that name them (run seed, round, group, sample index), so a synchronous run, an
asynchronous one and a resumed one draw the same numbers (rollout/transformers_engine.py, pipeline/source.py).
"""

from __future__ import annotations

import hashlib

import torch


def row_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (e.g. group seed and sample index), stable across processes.

    BLAKE2b (8-byte digest) of the decimal integers joined by commas, little-endian, shifted right by one so the
    result fits a signed 64-bit ``torch.Generator.manual_seed``. Python's ``hash`` is salted per process, hence a
    cryptographic hash. Raises ``ValueError``/``TypeError`` when a part is not convertible by ``int``.
    """
    h = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def forked_rngs():
    """``torch.random.fork_rng`` over the CPU generator and every CUDA device's: a block that seeds its own stream
    (``torch.manual_seed`` seeds the CUDA generators too) leaves the caller's streams as they were. ``fork_rng(
    devices=[])`` restored the CPU generator alone, so on a GPU the block's seed stayed in the CUDA generators.
    Only once CUDA is initialized (a CPU run on a GPU machine starts no CUDA context here; a seed set before CUDA
    starts is applied when it does, and the run's own seeding comes later). Forking CUDA devices is untested here
    (no GPU in the sessions that wrote it)."""
    return torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else [])
