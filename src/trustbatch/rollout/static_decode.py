"""Static-cache decoding for the transformers engine: one fixed-shape decode step, optionally ``torch.compile``d.

``generate`` with a dynamic cache runs a Python loop of ~10 kernel launches per layer per token, at shapes that
grow by one position per token; on a GPU a 0.5B model's decoding is then bound by launch overhead and by the CPU's
per-row noise draws (658 new tokens/s on an H200, docs/performance.md). This loop keeps every shape fixed for a whole chunk instead, so the decode
step can be compiled, on CUDA into a CUDA graph (``mode="reduce-overhead"``):

* the key/value cache is a transformers ``StaticCache`` of ``L`` positions (prompt − 1 + new tokens, rounded up to a
  multiple of ``BUCKET`` so a run's varying prompt widths share a few compiled shapes), written in place at its
  ``cumulative_length`` (a tensor, so the step does not change with the position);
* the 2D attention mask [N, L] is set once per chunk: the prompts' left padding, then ones; the causal mask (key
  position ≤ query position) hides what is not yet written, so no column changes while decoding;
* every step feeds one token per row [N, 1] at position (real prompt length − 1 + step), as ``generate`` does.

Prompt: its first P − 1 columns are prefilled (eagerly), then the decode loop starts from the last prompt token, as
the dynamic engine's prefill-once path does. Given ``row_slot`` the prefill runs each distinct prompt once and its
cache rows are copied to the rows of its samples (prefill once, as ``TransformersEngine._shared_prefill``).

Sampling is the dynamic path's, computed from the same functions (``rollout.gumbel``): the same processors
(transformers' ``TemperatureLogitsWarper``/``TopPLogitsWarper``) on the float32 last-position logits, the same
per-row uniforms (a stream of either kind; a ``philox`` step is computed inside the compiled step), Gumbel-max, and
the log-softmax of the processed scores at the sampled token. Stopping is
``generate``'s: a row that sampled EOS gets the pad token from then on (it keeps being computed, masked out by its
EOS cut), and the loop ends when every row has finished (checked every step on a CPU, every ``CHECK_EVERY`` steps
on a GPU, where the check waits for the device) or after ``max_new_tokens`` steps.

What differs from the dynamic path is float round-off only: attention runs over L key positions, the masked ones
weighted exactly 0, so its reductions may group the sums differently (float32 on the CPU: ≤ 1.9e-6 in the log-probs,
below either loop's own float32 error; the same tokens; ``tests/unit/test_static_decode.py``).

CUDA (``static_compiled``): untested here (no GPU was lent to the session that wrote it); prepared in
``tests/gpu/test_static_decode_cuda.py`` and the ``engine`` section of ``bench/gpu_check.py``.
"""

from __future__ import annotations

import collections

import torch

from ..policy.budget import vocab_size
from ..policy.kv_cache import cache_kwarg, growing_cache_fits, output_cache
from ..policy.shared_prompt import shared_prompt_unsupported
from .engine import end_ids_of
from .gumbel import gumbel_pick, noise_stream, uniforms

DECODES = ("dynamic", "static", "static_compiled")
BUCKET = 64  # cache positions are rounded up to a multiple of this: fewer distinct compiled shapes
CHECK_EVERY = 8  # on a GPU, steps between checks that every row has finished (each check waits for the device)
KEEP = 3  # chunk shapes whose caches a decoder keeps (each at most the engine's kv_bytes, 4 GiB by default)


def transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model a peft wrapper holds (its adapters are injected into that model's own layers, so its
    forward computes W x + (α/r)·B A x as the wrapper's does), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and hasattr(model, "peft_config") else model


def static_decode_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode with a ``StaticCache`` here, or None if it can.

    Needs what the shared-prompt forward needs (``policy.shared_prompt.shared_prompt_unsupported``: a decoder-only
    transformers model taking ``position_ids``, ``attention_mask`` and a cache, full attention, no ALiBi), that the
    cache ``generate`` would build has only plain full-attention layers (``policy.kv_cache.growing_cache_fits``), and a
    transformers whose ``StaticLayer`` keeps its own write position (``cumulative_length``, transformers ≥ 5.4). A peft
    model is judged (and decoded) by the transformers model inside (``transformers_model``).
    """
    model = transformers_model(model)
    reason = shared_prompt_unsupported(model, inference=True)  # decoding runs in eval mode: checkpointing is off
    if reason is not None:
        return reason
    if not growing_cache_fits(model):
        return "its generation cache is not one of plain full-attention layers"
    from transformers.cache_utils import StaticLayer

    if "cumulative_length" not in vars(StaticLayer(max_cache_len=1)):
        import transformers

        return (f"transformers {transformers.__version__}'s StaticLayer takes cache positions from the model "
                "(5.4 and later keep their own)")
    return None


RECOMPILE_LIMIT = 64  # graphs of the compiled step per process (dynamo's recompile_limit, at least)


def _step(model, name: str, cache, ids, pos, mask, noise, procs, record: bool):
    """One decoding step at fixed shapes: the model on ``ids`` [N, 1] at ``pos`` [N, 1] (mask [N, L], ``cache``
    written in place), then ``generate``'s float32 last-position logits, the processors and Gumbel-max with the
    stream step ``noise`` (``rollout.gumbel.uniforms``; None: greedy).
    Returns (token [N, 1], logp [N], lsm [N, V] or None)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{name: cache})
    scores = out.logits[:, -1, :].to(dtype=torch.float32, copy=True)
    for p in procs:
        scores = p(ids, scores)
    _, token, logp, lsm = gumbel_pick(scores, uniforms(noise, scores.shape[-1]), record)
    return token, logp, lsm


def compile_options(device: torch.device) -> dict:
    """Inductor options of the compiled step: on CUDA ``triton.cudagraphs`` (what ``mode="reduce-overhead"`` sets);
    ``emulate_precision_casts`` where this torch has it: a fused kernel rounds to bf16 wherever the eager ops would,
    so under the learner's bf16 autocast the step computes what the learner's eager forward computes (on the CPU,
    1 − ESS against the bf16-mixed learner: 2.9e-4 without it, 8.9e-5 with it, the dynamic loop's 7.4e-5;
    ``tests/unit/test_static_decode.py``)."""
    import torch._inductor.config as inductor

    opts = {"triton.cudagraphs": True} if device.type == "cuda" else {}
    if hasattr(inductor, "emulate_precision_casts"):
        opts["emulate_precision_casts"] = True
    return opts


class StaticDecoder:
    """Decodes chunks of left-padded prompts with a ``StaticCache`` kept between chunks of the same shape.

    ``compiled``: the step goes through ``torch.compile`` (``dynamic=False``: one graph per chunk shape; on CUDA
    with CUDA graphs, as ``mode="reduce-overhead"``; ``compile_options``). The cache and the step's input
    buffers are kept per (model, rows, positions, dtype, autocast, device), for the ``KEEP`` shapes used last, and
    reused (zeroed) by the next chunk of that shape: a CUDA graph then sees the same addresses again, where new ones
    would make it re-record (transformers marks the cache's tensors static without a guard), and a run whose prompt
    widths alternate between a few buckets re-records nothing.
    CUDA (CUDA graphs, the buffers' static addresses): untested (no GPU was lent to the session that wrote it).
    """

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        self._compiled = {}  # device type -> compiled step
        self._held: collections.OrderedDict = collections.OrderedDict()  # key -> (cache, mask, cur, pos), LRU

    def _step_fn(self, device: torch.device):
        if not self.compiled:
            return _step
        if device.type not in self._compiled:
            # one graph per (rows, cache bucket, sampled or greedy), for every engine of the process (they compile the
            # same function, whose graphs dynamo counts together): past its default of 8 a new shape ran uncompiled
            # (no CUDA graph) for the rest of the run
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self._compiled[device.type] = torch.compile(_step, dynamic=False, options=compile_options(device))
        return self._compiled[device.type]

    def _buffers(self, model, rows: int, positions: int, device: torch.device):
        from transformers import StaticCache

        dtype = next(model.parameters()).dtype
        amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        key = (id(model), rows, positions, dtype, amp, device)
        if key in self._held:
            self._held.move_to_end(key)
            self._held[key][0].reset()
            return self._held[key]
        while len(self._held) >= KEEP:  # free the least recently used first
            self._held.popitem(last=False)
        cache = StaticCache(config=model.config, max_cache_len=positions)
        bufs = (torch.zeros(rows, positions, dtype=torch.long, device=device),
                torch.zeros(rows, 1, dtype=torch.long, device=device),
                torch.zeros(rows, 1, dtype=torch.long, device=device))
        for b in bufs:  # fixed addresses: a CUDA graph reads them in place instead of copying them in
            torch._dynamo.mark_static_address(b)
        self._held[key] = (cache, *bufs)
        return self._held[key]

    def decode(self, model, ids: torch.Tensor, att: torch.Tensor, procs, seeds: list[int] | None, *,
               max_new_tokens: int, eos_id: int | tuple[int, ...], pad_id: int, row_slot: list[int] | None = None,
               record: bool = False, noise: str = "generator", noise_threads: int | None = None):
        """Sample up to ``max_new_tokens`` tokens after each row of ``ids`` [N, P] (left-padded, ``att`` its mask).

        Args:
            procs: the score processors, applied in order as ``p(input_ids, scores)`` (transformers' warpers).
            seeds: one random stream per row, of kind ``noise`` (``rollout.gumbel.noise_stream``; ``noise_threads``
                CPU threads draw a generator stream), or None for greedy decoding.
            row_slot: prefill once: row j's prompt is distinct prompt ``row_slot[j]`` (equal ids); None: every row.
            record: also keep each step's whole log-softmax.

        Returns:
            (tokens [N, S] long, logp [N, S] float32, lsm [N, S, V] float32 or None) on the model's device, S ≤
            ``max_new_tokens`` the steps run; after a row's EOS its tokens are ``pad_id`` (``generate``'s rule).
        """
        model = transformers_model(model)
        device = ids.device
        N, P = ids.shape
        positions = -(-(P - 1 + max_new_tokens) // BUCKET) * BUCKET
        name = cache_kwarg(model)
        cache, mask, cur, pos = self._buffers(model, N, positions, device)
        mask.fill_(1)
        mask[:, :P] = att
        pos_all = (att.cumsum(-1) - 1).masked_fill(att == 0, 0)  # generate's positions (pads at 0, masked anyway)
        if P > 1:
            self._prefill(model, name, cache, ids[:, :P - 1], mask, pos_all[:, :P - 1], row_slot)
        cur.copy_(ids[:, P - 1:])
        pos.copy_(pos_all[:, P - 1:])
        stream = noise_stream(noise, seeds, vocab_size(model), device, noise_threads)
        tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
        logp = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=device)
        full = [] if record else None
        unfinished = torch.ones(N, 1, dtype=torch.bool, device=device)
        ends = torch.tensor(end_ids_of(eos_id), dtype=torch.long, device=device)
        check = 1 if device.type == "cpu" else CHECK_EVERY
        steps = 0
        for t in range(max_new_tokens):
            # the first step of an unfilled cache (one-token prompts) runs eagerly: it allocates the cache
            step = self._step_fn(device) if cache.layers[0].is_initialized else _step
            noise_t = None if stream is None else stream.next()
            if step is not _step and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            tok, lp, lsm = step(model, name, cache, cur, pos, mask, noise_t, tuple(procs), record)
            tok = torch.where(unfinished, tok, pad_id)
            tokens[:, t:t + 1] = tok
            logp[:, t] = lp
            if full is not None:
                full.append(lsm.clone())
            unfinished &= ~torch.isin(tok, ends)
            cur.copy_(tok)
            pos.add_(1)
            steps = t + 1
            if steps % check == 0 and not bool(unfinished.any()):
                break
        return tokens[:, :steps], logp[:, :steps], None if full is None else torch.stack(full, dim=1)

    @staticmethod
    def _prefill(model, name, cache, ids, mask, pos, row_slot):
        """Write the cache's first ``ids.shape[1]`` positions: the rows' prompts less their last token."""
        if row_slot is None:
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                  logits_to_keep=torch.zeros(0, dtype=torch.long, device=ids.device), **{name: cache})
            return
        first = [row_slot.index(s) for s in range(max(row_slot) + 1)]  # a row of each distinct prompt
        n = ids.shape[1]
        out = model(input_ids=ids[first], attention_mask=mask[first, :n], position_ids=pos[first], use_cache=True,
                    logits_to_keep=torch.zeros(0, dtype=torch.long, device=ids.device))
        select = torch.tensor(row_slot, device=ids.device)
        for layer, src in zip(cache.layers, output_cache(out).layers):
            k, v = src.keys.index_select(0, select), src.values.index_select(0, select)
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys[:, :, :n].copy_(k)
            layer.values[:, :, :n].copy_(v)
            layer.cumulative_length.fill_(n)

