"""The transformers engine's sampler, shared by its decode loops: Gumbel-max over per-row random streams.

token = argmax(s + g), s the processed scores (logits / T, top-p filtered), g standard Gumbel noise -log(-log(u))
with u uniform on (0, 1) from the row's own stream (Gumbel 1954; the Gumbel-max trick: the argmax is distributed as
softmax(s)). Both decode loops (``generate``'s, ``rollout.static_decode``'s) draw through ``noise_stream`` and pick
with ``gumbel_pick``, so the same seeds give the same noise and the same recorded log-probs whichever loop runs.

Two kinds of stream (``NOISES``), one per completion, seeded by its row seed:

* ``generator`` (the default; every earlier run's): a CPU ``torch.Generator`` (mt19937) per row, one
  ``torch.rand(V)`` per step. A step costs N · V CPU draws: at V = 151,936 and 512 rows ~78M numbers, ~0.3–0.7 s on
  one core, more than a compiled decode step of a 0.5B model on a GPU. ``GeneratorStream`` draws them on up to
  ``torch.get_num_threads()`` threads (each row's generator on one thread, so the numbers are unchanged), and on CUDA
  draws step t + 1 into pinned memory while the device runs step t.
* ``philox``: Philox4x32-10 (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3"; the
  counter-based generator behind torch's and cuRAND's CUDA streams), evaluated with torch integer ops on the
  model's device: key = the row seed's two 32-bit halves, counter = (token block, step, 0, 0), four tokens per
  block; u = (⌊w / 2^9⌋ + 1/2) / 2^23 for each 32-bit output word w, so u lies strictly inside (0, 1). No CPU work,
  no transfer, and the same numbers on any device (integer arithmetic); another stream than ``generator``'s for
  the same seeds, so samples differ from a ``generator`` run's.

Limits of both streams (worked out by enumerating every uniform a stream can give, two tokens a logit gap D apart):
u has 23–24 bits, so the noise is bounded (g ≤ 16.6) and the rarest tokens are drawn too rarely. ``generator``'s
u = k / 2^24 sits at the left of each step: a token of probability 8e-7 comes 3.5 % too rarely, 1e-7 24 %, and one
below about 2e-9 never; ``philox``'s centred grid is within 0.1 % at 8e-7 and 5 % at 1e-7, and cuts off near 1e-8.
The recorded log-probs are those of softmax(s) all the same. On stories260K such tokens hold about 1.6e-5 of a
step's probability. And torch's mt19937 keeps only the low 32 bits of a seed, so two rows whose 63-bit seeds share
them draw the same noise: about 2 pairs among a default run's 128,000 rows (philox is keyed by all 64 bits).
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch

NOISES = ("generator", "philox")
PARALLEL_MIN = 1 << 20  # numbers per step from which a generator stream draws on several threads

_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Random123's PHILOX_M4x32_0/1
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # its Weyl key increments PHILOX_W32_0/1


def row_uniforms(gens: list[torch.Generator], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One step of every row's generator stream: [len(gens), vocab] float32 uniforms on [0, 1), moved to ``device``.

    Row r is ``torch.rand(vocab, generator=gens[r])`` on the CPU (so the numbers do not depend on the device the
    model runs on), advancing that generator by one step.
    """
    return torch.stack([torch.rand(vocab, generator=g) for g in gens]).to(device)


def _mulhilo(a: torch.Tensor, m: int):
    """(high, low) 32-bit halves of a · m for int64 ``a`` in [0, 2^32) and a constant m < 2^32, without int64
    overflow: m is split in 16-bit halves, so each partial product stays below 2^48."""
    lo_part, hi_part = a * (m & 0xFFFF), a * (m >> 16)
    s = lo_part + ((hi_part & 0xFFFF) << 16)
    return (hi_part >> 16) + (s >> 32), s & _M32


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-``rounds`` of int64 tensors holding 32-bit words (broadcastable): counter (c0, c1, c2, c3), key
    (k0, k1) → four output words. Random123's definition (philox.h): each round maps (c0, c1, c2, c3) to
    (hi(M1·c2) ^ c1 ^ k0, lo(M1·c2), hi(M0·c0) ^ c3 ^ k1, lo(M0·c0)), the key bumped by (W0, W1) between rounds.
    Checked against its published known answers (``tests/unit/test_static_decode.py``)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_uniforms(keys: torch.Tensor, step: torch.Tensor | int, vocab: int) -> torch.Tensor:
    """Step ``step`` of each row's Philox stream: [N, vocab] float32 uniforms in (0, 1) on ``keys``' device.

    keys: [N] int64 row seeds in [0, 2^63) (``seeding.row_seed``); step: the decoding step (an int, or a 0-d int64
    tensor so a compiled step does not change with it). Token v takes word v mod 4 of counter (⌊v / 4⌋, step, 0, 0).
    """
    blocks = -(-vocab // 4)
    n = keys.shape[0]
    c0 = torch.arange(blocks, device=keys.device).expand(n, blocks)
    c1 = torch.zeros_like(c0) + step
    zero = torch.zeros_like(c0)
    words = torch.stack(philox4x32((c0, c1, zero, zero), ((keys & _M32)[:, None], (keys >> 32)[:, None])), dim=-1)
    return ((words.reshape(n, 4 * blocks)[:, :vocab] >> 9).to(torch.float32) + 0.5) * 2.0**-23


def gumbel_pick(scores: torch.Tensor, u: torch.Tensor | None, record: bool = False):
    """The sampled token and its behaviour log-prob from one step's processed scores.

    Args:
        scores: [N, V] processed scores (after temperature and top-p; -inf outside the nucleus).
        u: [N, V] uniforms (a stream's step) on the scores' device, or None for greedy decoding (argmax of scores).
        record: also return the whole log-softmax.

    Returns:
        (noisy, token, logp, lsm): noisy [N, V] = scores + Gumbel noise (what ``generate`` takes the argmax of),
        token [N, 1] long = argmax(noisy), logp [N] = log_softmax(scores) at token in at least float32 (the processed
        distribution sampled from, without noise), lsm [N, V] that log-softmax when ``record`` else None.
    """
    noisy = scores
    if u is not None:
        noisy = scores - torch.log(-torch.log(u.clamp_min(1e-20)))
    token = noisy.argmax(-1, keepdim=True)
    # generate's scores are float32 whatever the model (it casts each step's logits); promote in case it changes
    lsm = torch.log_softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return noisy, token, lsm.gather(-1, token).squeeze(-1), (lsm if record else None)


def uniforms(step_noise, vocab: int) -> torch.Tensor | None:
    """A stream step's [N, vocab] uniforms: ``GeneratorStream.next()``'s tensor as it is, ``PhiloxStream.next()``'s
    (keys, step) evaluated here (inside a compiled decode step, so the device computes it fused), None for greedy."""
    if isinstance(step_noise, tuple):
        return philox_uniforms(*step_noise, vocab)
    return step_noise


class PhiloxStream:
    """Each row's Philox stream: ``next()`` gives (keys [N] int64, step 0-d int64) on ``device`` for ``uniforms``.

    The step tensor is one tensor advanced in place, so a compiled step sees the same input every call.
    """

    def __init__(self, seeds: list[int], device: torch.device | str):
        self.keys = torch.tensor(seeds, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self._started = False

    def next(self):
        if self._started:
            self.step.add_(1)
        self._started = True
        return self.keys, self.step


_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (workers, pool), shared by every stream
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] < threads:
            _POOL = (threads, concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gumbel"))
        return _POOL[1]


class GeneratorStream:
    """Each row's ``torch.Generator`` stream: ``next()`` gives the step's [N, vocab] uniforms on ``device``, the
    numbers ``row_uniforms`` gives, step after step.

    ``threads`` (default ``torch.get_num_threads()``) CPU threads draw a step's rows, each row on one thread (a
    generator's draws stay in order), when the step holds ≥ ``min_parallel`` numbers; below that, one loop (thread
    dispatch would cost more). On CUDA the stream draws one step ahead into pinned host memory (two buffers) and
    copies it without blocking: the CPU draws step t + 1 while the device computes step t.
    CUDA: untested (no GPU was lent to the session that wrote it); ``tests/gpu/test_static_decode_cuda.py``.
    """

    def __init__(self, seeds: list[int], vocab: int, device: torch.device | str, threads: int | None = None,
                 min_parallel: int = PARALLEL_MIN):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.vocab, self.device = vocab, torch.device(device)
        threads = torch.get_num_threads() if threads is None else threads
        self.threads = max(1, min(threads, len(seeds))) if len(seeds) * vocab >= min_parallel else 1
        self._ahead = self.device.type == "cuda"
        self._bufs: list[torch.Tensor] = []
        self._events: list = [None, None]
        self._pending: list = []
        self._i = 0

    def _draw_rows(self, buf: torch.Tensor, lo: int, hi: int) -> None:
        for r in range(lo, hi):
            buf[r].uniform_(0, 1, generator=self.gens[r])  # the numbers of torch.rand(V, generator=g)

    def _draw(self, buf: torch.Tensor) -> list:
        """Start drawing one step into ``buf``; the futures to wait for (none when drawn on this thread)."""
        n = len(self.gens)
        if self.threads == 1:
            self._draw_rows(buf, 0, n)
            return []
        bounds = [n * i // self.threads for i in range(self.threads + 1)]
        pool = _pool(self.threads)
        return [pool.submit(self._draw_rows, buf, lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]

    def next(self) -> torch.Tensor:
        if not self._ahead:
            buf = torch.empty(len(self.gens), self.vocab)
            for f in self._draw(buf):
                f.result()
            return buf.to(self.device)
        if not self._bufs:
            pin = self.device.type == "cuda"  # page-locked: the copy to the device does not block this thread
            self._bufs = [torch.empty(len(self.gens), self.vocab, pin_memory=pin) for _ in range(2)]
            self._pending = self._draw(self._bufs[0])
        i, j = self._i, 1 - self._i
        for f in self._pending:
            f.result()
        out = self._bufs[i].to(self.device, non_blocking=True)
        self._events[i] = torch.cuda.Event()
        self._events[i].record()
        if self._events[j] is not None:  # buffer j's copy (the step before) must be done before it is redrawn
            self._events[j].synchronize()
        self._pending = self._draw(self._bufs[j])
        self._i = j
        return out


def noise_stream(kind: str, seeds: list[int] | None, vocab: int, device: torch.device | str,
                 threads: int | None = None):
    """The rows' stream of ``kind`` (``NOISES``), or None for greedy decoding (``seeds`` None).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in NOISES:
        raise ValueError(f"noise={kind!r} is not one of {NOISES}")
    if seeds is None:
        return None
    if kind == "philox":
        return PhiloxStream(seeds, device)
    return GeneratorStream(seeds, vocab, device, threads)
