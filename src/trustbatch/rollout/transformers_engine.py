"""Rollouts with ``transformers`` ``generate`` on CPU (or any torch device).

Sampling is Gumbel-max with one random stream per completion: token = argmax(s + g), where s are the
processed scores (logits / T, top-p filtered) and g is standard Gumbel noise drawn from that
completion's own ``torch.Generator``. That draws from softmax(s) (Gumbel 1954; the Gumbel-max trick; down to
token probabilities near 1e-7: ``rollout.gumbel``'s limits), and makes a completion depend only on its seed, prompt and weights, never on
which other prompts share the batch or which process generates it: what lets an asynchronous
pipeline reproduce a synchronous one.

Prefill once (``prefill_once``; the default except at int8): the G samples of a prompt share its
prefix, so each distinct prompt of a chunk is run once (all its tokens but the last) and its
key/value cache is copied to the G rows (``Cache.batch_select_indices``) before ``generate``
continues from it, feeding each row the last prompt token. The padding, positions and masks are
those of the plain path, so the distribution sampled is the same; only float round-off between
batch shapes differs (float32: ~1 ulp of the log-probs; ``tests/unit/test_prefill_once.py``).

Per-tensor FP8 (``fp8_e4m3``) scales each Linear's input by its absmax over the whole forward, so
splitting the plain path's first forward ([N, P]) into a prefill ([U, P-1]) and a last-token step
([N, 1]) would change the scales, and with them the distribution. The engine therefore first runs
the U distinct prompts whole ([U, P]: the N rows' values without the repeats, so the same absmax)
and has both pieces reuse each layer's scale from that pass (``Fp8Linear.reuse_scale``). What is
left is float round-off, as in float32 (the last prompt token is computed in its own step), except
that a round-off change that moves a value across an FP8 rounding boundary moves it by a whole FP8
step: most batches sample bit for bit what the plain path samples, a few differ at a few tokens
(``bench/fp8_prefill.py``, ``tests/unit/test_prefill_once.py``). int8 takes its scales inside torch's
quantized kernels, where they cannot be carried over, and keeps the plain path.

The key/value cache is a ``policy.kv_cache.GrowingCache`` (appends into spare room, no re-copy of
the whole cache per token) wherever it fits the model; its samples and log-probs equal those with
``generate``'s own cache bit for bit (``tests/unit/test_kv_cache.py``; speed: ``bench/kv_cache.py``).

``decode="static"`` replaces ``generate``'s loop by ``rollout.static_decode``'s: a ``StaticCache`` and fixed shapes
for a whole chunk, the same processors, noise and stopping rule; ``"static_compiled"`` also compiles its step
(CUDA graphs on a GPU). In float32, samples equal the dynamic loop's, log-probs to float round-off
(``tests/unit/test_static_decode.py``); at bf16 or fp16 the two loops' round-off differs, and so do some samples
(each loop's samples follow its own recorded log-probs). Not for the batch-scaled precisions (int8, fp8_e4m3).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import (Cache, GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                          TopPLogitsWarper)

from ..policy.budget import KV_BYTES, LOGITS_BYTES, generate_rows
from ..policy.forward import Recorded, Teacher, refuse_empty_prompts
from ..policy.kv_cache import GrowingCache, cache_kwarg, growing_cache_fits, output_cache
from ..policy.shared_prompt import recurrent
from ..seeding import row_seed
from .engine import Rollout, SamplingParams, end_ids_of
from .gumbel import NOISES, gumbel_pick, noise_stream, uniforms
from .shifts import REQUANTIZED, batch_scaled_linears, behaviour_copy
from .static_decode import DECODES, StaticDecoder, static_decode_unsupported


# Rollout precisions whose activation quantization scale is taken over the whole batch tensor
# (rollout.shifts): their sampled distribution depends on which rows share a forward.
BATCH_SCALED = ("int8", "fp8_e4m3")
# Of those, the ones whose scales cannot be handed from one forward to the next: no prefill once.
PLAIN_ONLY = ("int8",)


class _GumbelPerRow(LogitsProcessor):
    """Adds per-row Gumbel noise after the warpers, and records the log-prob of the token each row samples.

    ``generate`` (``do_sample=False``) takes the argmax of the scores this returns, so the token is known here:
    ``logprobs`` gets, per step, log_softmax(clean processed scores) at that token ([N], float32), and no step's
    [N, V] scores outlive the step, unless ``record``: then ``full`` keeps each step's whole log_softmax [N, V]
    (the distribution sampled from, whose values at the tokens are ``logprobs``). The noise (``noise``: the
    streams' kind, ``rollout.gumbel.NOISES``) and the pick are ``rollout.gumbel``'s, shared with the static loop.
    """

    def __init__(self, seeds: list[int] | None, record: bool = False, noise: str = "generator",
                 threads: int | None = None):
        self.seeds, self.noise, self.threads = seeds, noise, threads
        self.stream = None
        self.logprobs: list[torch.Tensor] = []
        self.full: list[torch.Tensor] | None = [] if record else None

    def __call__(self, input_ids, scores):
        V = scores.shape[-1]
        if self.stream is None:
            self.stream = noise_stream(self.noise, self.seeds, V, scores.device, self.threads)
        u = None if self.stream is None else uniforms(self.stream.next(), V)  # None: greedy
        noisy, _, logp, lsm = gumbel_pick(scores, u, record=self.full is not None)
        self.logprobs.append(logp)
        if self.full is not None:
            self.full.append(lsm)
        return noisy


class TransformersEngine:
    """Samples with ``model.generate`` and records behaviour log-probs from the processed scores.

    ``generate`` returns, per step, the scores after temperature and top-p; their log-softmax at
    the sampled token is exactly the log-prob under the sampling distribution.

    ``eos_id``: the token that ends a completion, or several (``Policy.end_ids``: an Instruct model's end of turn
    beside the tokenizer's EOS); a completion ends at the first of them, which it keeps.

    With ``share=True`` (the default in float32) the engine samples from ``model`` itself and
    ``load_weights`` with no tensors only moves the version; otherwise it keeps its own copy in
    ``precision`` (see ``rollout.shifts``) and loads the learner's named weights into it, cast to
    that precision (int8 and FP8: re-quantized from a float copy).

    At float32 it keeps no step's scores: the whole behaviour distribution, which an exact KL needs, is rebuilt by
    the learner from ``teacher`` (the module and settings it samples with), so the engine declares ``full``
    (``rollout.spec.behaviour_distribution``). At any other precision teacher forcing does not rebuild what
    decoding sampled from (``rollout.spec``'s measurements), so it declares ``recorded``: with ``record`` it keeps
    each step's whole log-softmax and returns it with each rollout (``Rollout.behavior_logprobs_full``
    [len(completion_ids), V] float32; [rows, steps, V] on the device during a generate call), and ``teacher``
    says so (``policy.forward.Recorded``). ``record`` at float32 is refused (ValueError): there it rebuilds.

    Sequences per ``generate`` call: at most ``batch_size``, and fewer where one decoding step's ``[rows, V]``
    scores would pass ``logits_bytes`` or the rows' key/value cache ``kv_bytes`` (``policy.budget.generate_rows``;
    at V = 151,936: 441 rows). Where every row fits in one call (small V), the calls are those of a plain
    ``batch_size`` split; where the bound splits a batch, each completion keeps its own random stream, so only
    float round-off between batch shapes changes (the batch-scaled int8/FP8 precisions excepted: there the rows
    sharing a forward set the scales, as ``batch_size`` already does).

    ``prefill_once`` prefills each distinct prompt of a chunk once and copies its key/value cache
    to its samples (module docstring); False runs every row's prompt, as ``generate`` alone does.
    None (the default) means True except at int8 (``PLAIN_ONLY``), which scales activations per
    tensor over the whole batch inside torch's kernels, so which rows share a forward changes the
    distribution itself (by ~1e-2 in the log-probs, not round-off). Per-tensor FP8 prefills once
    with the whole forward's scales carried over (module docstring). A model whose forward returns
    no ``transformers.Cache`` falls
    back to the plain path. ``grow_cache`` (set from ``growing_cache_fits``) says whether generation
    uses a ``GrowingCache``.

    ``noise``: the kind of per-row random stream (``rollout.gumbel.NOISES``: ``"generator"``, every earlier run's
    streams, or ``"philox"``, counter-based on the model's device); ``noise_threads``: CPU threads that draw a
    generator stream's step (None: ``torch.get_num_threads()``; the numbers do not depend on it).

    ``decode``: ``"dynamic"`` (``generate``), ``"static"`` or ``"static_compiled"`` (``rollout.static_decode``; there
    a batch the row bounds split is split into equal chunks, so they share one compiled shape, and prefill once
    applies to chunks with a repeated prompt as above). Raises ValueError for an unknown ``decode``, a static one at a
    batch-scaled precision (int8, fp8_e4m3) or for a model it cannot run (``static_decode_unsupported``), and for an
    unknown ``noise``.
    """

    def __init__(self, model: torch.nn.Module, eos_id: int | tuple[int, ...], pad_id: int, *, batch_size: int = 512,
                 logits_bytes: int = LOGITS_BYTES, kv_bytes: int = KV_BYTES,
                 precision: str = "float32", share: bool | None = None, version: int = 0,
                 prefill_once: bool | None = None, autocast: torch.dtype | None = None, record: bool = False,
                 decode: str = "dynamic", noise: str = "generator", noise_threads: int | None = None):
        if record and precision == "float32":
            raise ValueError("a float32 engine's distribution is rebuilt by the learner (teacher); record=False")
        if decode not in DECODES:
            raise ValueError(f"decode={decode!r} is not one of {DECODES}")
        if noise not in NOISES:
            raise ValueError(f"noise={noise!r} is not one of {NOISES}")
        self.noise, self.noise_threads = noise, noise_threads
        if decode != "dynamic" and precision in BATCH_SCALED:
            raise ValueError(f"decode={decode!r} does not run precision={precision!r}: its activation scales are taken "
                             "over each forward's whole batch (rollout.shifts); use decode='dynamic'")
        self.precision = precision
        self.record = record
        # the learner's bf16-mixed autocast, for an engine that samples from the learner's own module: the
        # engine then computes what the learner computes (scale-up.md invariant 1); None: plain forwards
        self.autocast = autocast
        share = precision == "float32" if share is None else share
        if share and precision != "float32":
            raise ValueError(f"a {precision} engine cannot share the float32 module; pass share=False")
        self.shared = share
        self.model = model if share else behaviour_copy(model, precision)
        # quantized modules cannot load float weights, so an int8 engine re-quantizes a float copy
        self._float_model = copy.deepcopy(model) if precision in REQUANTIZED else None
        self.end_ids = end_ids_of(eos_id)
        self.eos_id = self.end_ids[0]
        self.pad_id = pad_id
        self.batch_size, self.logits_bytes, self.kv_bytes = batch_size, logits_bytes, kv_bytes
        self.version = version
        self.prefill_once = precision not in PLAIN_ONLY if prefill_once is None else prefill_once
        # decided once: load_weights may replace self.model, but only by a copy of the same architecture
        self.grow_cache = growing_cache_fits(self.model)
        self.decode = decode
        self._static = None
        if decode != "dynamic":
            reason = static_decode_unsupported(self.model)
            if reason is not None:
                raise ValueError(f"decode={decode!r} cannot run {type(self.model).__name__}: {reason}; "
                                 "use decode='dynamic'")
            self._static = StaticDecoder(compiled=decode == "static_compiled")

    def load_weights(self, weights, version: int) -> None:
        """Load named float tensors (the full state) as policy ``version``; see ``Engine.load_weights``.

        Raises:
            ValueError: no tensors for an engine with its own copy; missing or unexpected names
                (``load_state_dict`` strict).
        """
        state = dict(weights)
        if not state:
            if not self.shared:
                raise ValueError("load_weights got no tensors, but this engine holds its own copy of the "
                                 "policy; send the full named state")
        elif self._float_model is not None:
            self._float_model.load_state_dict(state)
            self.model = behaviour_copy(self._float_model, self.precision)
        else:
            self.model.load_state_dict(state)  # copy_ casts to bf16/fp16
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 seeds: list[int] | None = None) -> list[Rollout]:
        """``n`` completions per prompt, grouped; see ``Engine.generate``.

        ``seeds`` (one per prompt) fix each group's random streams: completion j of prompt i is drawn
        from ``row_seed(seeds[i], j)``. None draws the group seeds from torch's global generator.

        Raises:
            ValueError: a prompt without tokens, or not one seed per prompt.
        """
        refuse_empty_prompts(prompts)
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        elif len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        flat = [(i, p, row_seed(seeds[i], j)) for i, p in enumerate(prompts) for j in range(n)]
        out: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        ctx = torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None else contextlib.nullcontext()
        rows = generate_rows(self.model, max(map(len, prompts), default=0) + sampling.max_new_tokens,
                             max_rows=self.batch_size, logits_bytes=self.logits_bytes, kv_bytes=self.kv_bytes)
        if self._static is not None and flat:  # equal chunks: one shape (one compiled graph) for all of them
            rows = -(-len(flat) // -(-len(flat) // rows))
        try:
            with ctx:
                for s in range(0, len(flat), rows):
                    out.extend(self._generate_chunk(flat[s:s + rows], sampling, device))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, items, sp: SamplingParams, device: torch.device = torch.device("cpu")):
        P = max(len(p) for _, p, _ in items)
        ids = torch.full((len(items), P), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for j, (_, p, _) in enumerate(items):
            ids[j, P - len(p):] = torch.tensor(p)
            att[j, P - len(p):] = 1
        ids, att = ids.to(device), att.to(device)
        seeds = None if sp.greedy else [s for _, _, s in items]
        procs = [] if sp.greedy else [TemperatureLogitsWarper(sp.temperature)] + (
            [TopPLogitsWarper(sp.top_p)] if sp.top_p < 1.0 else [])
        if self._static is not None:
            slot = _prompt_slots(items) if self.prefill_once else None
            new, logp, full = self._static.decode(
                self.model, ids, att, procs, seeds, max_new_tokens=sp.max_new_tokens, eos_id=self.end_ids,
                pad_id=self.pad_id, row_slot=None if slot is None or max(slot) + 1 == len(items) else slot,
                record=self.record, noise=self.noise, noise_threads=self.noise_threads)
        else:
            new, logp, full = self._generate(ids, att, items, procs, seeds, sp)
        new, logp = new.cpu(), logp.cpu()  # [N, steps]; logp processed (T, top-p), no noise
        full = None if full is None else full.cpu()  # [N, steps, V]: the distributions sampled from
        rows = []
        for j, (i, p, _) in enumerate(items):
            toks = new[j].tolist()
            ended = next((k for k, t in enumerate(toks) if t in self.end_ids), None)
            end = len(toks) if ended is None else ended + 1
            rows.append(Rollout(
                prompt_index=i, prompt_ids=list(p), completion_ids=toks[:end],
                behavior_logprobs=logp[j, :end].tolist(), truncated=ended is None,
                policy_version=self.version,
                behavior_logprobs_full=None if full is None else full[j, :end].clone(),
            ))
        return rows

    def _generate(self, ids, att, items, procs, seeds, sp: SamplingParams):
        """``generate``'s decode loop (dynamic cache): (new tokens [N, steps], logp [N, steps], lsm [N, steps, V]
        or None) on the model's device."""
        P = ids.shape[1]
        # Greedy decoding over processed scores plus per-row Gumbel noise is sampling (module docstring);
        # HF's own sampler would draw every row from one global stream.
        noise = _GumbelPerRow(seeds, record=self.record, noise=self.noise, threads=self.noise_threads)
        # GrowingCache: the same attention numbers as generate's own DynamicCache, without re-copying the
        # whole cache at every token (policy.kv_cache)
        reserve = P + sp.max_new_tokens
        scaled = batch_scaled_linears(self.model)
        try:
            cache = self._shared_prefill(ids, att, items, reserve, scaled) if self.prefill_once else None
            if cache is None and self.grow_cache:
                cache = GrowingCache(reserve)
            with _only_our_sampling(self.model, list(self.end_ids), self.pad_id):
                gen = self.model.generate(
                    input_ids=ids, attention_mask=att, max_new_tokens=sp.max_new_tokens,
                    eos_token_id=list(self.end_ids), pad_token_id=self.pad_id, do_sample=False, top_k=None, top_p=None,
                    temperature=None, logits_processor=LogitsProcessorList(procs + [noise]), return_dict_in_generate=True,
                    **({} if cache is None else {cache_kwarg(self.model): cache}),
                )
        finally:
            for m in scaled:  # a scale left pending (generate failed before its first forward) must not leak
                m.reuse_scale(False)
        full = None
        if noise.full is not None:
            full = torch.stack(noise.full, dim=1)
            noise.full.clear()
        return gen.sequences[:, P:], torch.stack(noise.logprobs, dim=1), full

    def teacher(self, sampling: SamplingParams) -> Teacher | Recorded:
        """What the learner takes this engine's sampling distribution from: ``Recorded`` when the engine records
        it (``record``: its rollouts carry ``behavior_logprobs_full``), else the ``policy.forward.Teacher`` it
        rebuilds it from: the module it samples with (valid until the next ``load_weights``), the temperature
        (1 when greedy: the untempered scores) and its autocast.

        A Teacher of a precision other than float32 rebuilds another distribution than the one sampled (for
        per-tensor quantization, int8 and fp8_e4m3, the activation scales come from the learner's teacher-forced
        micro-batch, not each decoding step's rows; ``rollout.spec``'s measurements): runs record there.

        Raises:
            ValueError: top-p < 1 (π_b is 0 outside the nucleus, where KL(π_θ‖π_b) is infinite).
        """
        if sampling.top_p < 1.0 and not sampling.greedy:
            raise ValueError(f"top_p={sampling.top_p:g} truncates the behaviour distribution (π_b = 0 outside the "
                             "nucleus, KL(π_θ‖π_b) infinite); sample with top_p=1 for an exact KL")
        name = "the behaviour policy" if self.version >= 0 else "the foreign model"
        if self.record:
            return Recorded(name)
        return Teacher(self.model, 1.0 if sampling.greedy else sampling.temperature, self.autocast, name=name)

    def _shared_prefill(self, ids: torch.Tensor, att: torch.Tensor, items, reserve: int, scaled=()):
        """A key/value cache of ``ids[:, :P-1]`` [N, P-1] computed once per distinct prompt, or None.

        The distinct rows keep the chunk's left padding (width P) and ``generate``'s positions
        (attention-mask cumsum − 1, pads at 0), so each cached position is the plain path's; the
        cache is then indexed out to the N rows. The last prompt token is left to ``generate``,
        which needs at least one uncached input token. None (plain path) for one-token prompts, for
        chunks without a repeated prompt, and for models whose forward returns no ``Cache``.
        ``scaled`` (``rollout.shifts.batch_scaled_linears``): per-tensor FP8 layers, whose scales are
        first taken from the whole prompts [U, P] and then reused by the prefill and by ``generate``'s
        first forward (module docstring).
        Run on CPU only (tests/unit/test_prefill_once.py); untested on a GPU (none was available).
        """
        P = ids.shape[1]
        row_slot = _prompt_slots(items)
        first = [row_slot.index(s) for s in range(max(row_slot) + 1)]  # a row of each distinct prompt
        # a recurrent (stateful) cache cannot be indexed out to the rows: transformers' linear-attention layers have
        # no batch_select_indices (the run stopped with a traceback)
        if P < 2 or len(first) == len(items) or cache_kwarg(self.model) is None or \
                recurrent(self.model):
            return None
        if scaled:
            # the plain path's first forward over all N rows, less the repeats: each layer's scale
            w_att = att[first]
            w_pos = (w_att.cumsum(-1) - 1).masked_fill(w_att == 0, 0)
            self.model(input_ids=ids[first], attention_mask=w_att, position_ids=w_pos, use_cache=False, logits_to_keep=1)
            for m in scaled:
                m.reuse_scale()
        u_ids, u_att = ids[first, :P - 1], att[first, :P - 1]
        pos = (u_att.cumsum(-1) - 1).masked_fill(u_att == 0, 0)
        grow = {cache_kwarg(self.model): GrowingCache(reserve)} if self.grow_cache else {}
        out = self.model(input_ids=u_ids, attention_mask=u_att, position_ids=pos, use_cache=True, logits_to_keep=1, **grow)
        cache = output_cache(out)
        if not isinstance(cache, Cache):
            return None
        cache.batch_select_indices(torch.tensor(row_slot, device=u_ids.device))
        for m in scaled:  # generate's first forward, each row's last prompt token, takes the same scales
            m.reuse_scale()
        return cache


@contextlib.contextmanager
def _only_our_sampling(model: torch.nn.Module, eos_id: list[int], pad_id: int):
    """Within the block, every ``generation_config`` of ``model`` and its submodules (a peft wrapper copies its own
    onto the base model) is a blank one with only the special ids: ``generate`` fills each setting it is not given
    from the model's ``generation_config.json`` (an Instruct model's repetition penalty, top-k, a
    ``cache_implementation``), which would make the engine sample, and record, another distribution than
    ``SamplingParams`` describes and than the static loop and the learner's ``Teacher`` rebuild."""
    saved = [(m, m.__dict__["generation_config"]) for m in model.modules()
             if isinstance(m.__dict__.get("generation_config"), GenerationConfig)]
    for m, _ in saved:
        m.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    try:
        yield
    finally:
        for m, gen in saved:
            m.generation_config = gen


def _prompt_slots(items) -> list[int]:
    """Row j's distinct prompt, numbered in order of first appearance (equal token ids, equal number)."""
    slot: dict[tuple[int, ...], int] = {}
    return [slot.setdefault(tuple(p), len(slot)) for _, p, _ in items]
