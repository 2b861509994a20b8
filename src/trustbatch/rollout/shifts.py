"""Behaviour-policy shifts for the off-policy lab: lower precision (staleness is ``pipeline.weight_sync.LaggedSync``).

Precisions: float32 (no shift), bfloat16 and float16 (weights and compute in that dtype), int8
(dynamic quantization of every Linear), and an emulation of FP8-E4M3 weights and activations at two
scalings, ``fp8_e4m3`` (per-tensor) and ``fp8_e4m3_rowwise`` (per-row); see ``Fp8Linear``.

Each shift changes only the rollout side; the learner always trains the float32 policy at T = 1.
The behaviour log-probs recorded by the engine are those of the distribution actually sampled from,
so the ratio π_θ/μ that the objectives see measures exactly the shift.
(Temperature is a sampling argument of the engine itself; replay is ``train.epochs``/``minibatches``.)
"""

from __future__ import annotations

import copy
import warnings

import torch

FP8_SCALINGS = {"fp8_e4m3": "tensorwise", "fp8_e4m3_rowwise": "rowwise"}
PRECISIONS = ("float32", "bfloat16", "float16", "int8", *FP8_SCALINGS)
# Quantized copies cannot load float weights in place: an engine keeps a float copy and re-quantizes it.
REQUANTIZED = ("int8", *FP8_SCALINGS)
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: the largest finite E4M3 value (no inf in "fn")


def fp8_e4m3_qdq(x: torch.Tensor, scaling: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` to FP8-E4M3 and back (float32 out), with an absmax scale per tensor or per row.

    q = cast_e4m3(clamp(x / s, ±448)) · s with s = absmax / 448, so the largest |x| of each scaling
    group maps to E4M3's largest finite value and every value to its nearest E4M3 code (round to
    nearest even, torch's cast). The standard "current" (dynamic) scaling of FP8 recipes.

    Args:
        x: [..., K] float tensor (a Linear's weight [N, K] or its input [..., K]).
        scaling: "tensorwise": one scale for the whole tensor; "rowwise": one scale per row of the
            last dimension (per output channel of a weight, per token of an activation).
        amax: the absmax to scale by (tensorwise: a scalar tensor), instead of ``x``'s own; see
            ``Fp8Linear.reuse_scale``.

    Returns:
        float32 tensor of ``x``'s shape, values on the E4M3 grid times the scale. An all-zero group
        stays zero (its scale is set to 1).

    Raises:
        ValueError: an unknown scaling.
    """
    x = x.float()
    if scaling not in FP8_SCALINGS.values():
        raise ValueError(f"unknown FP8 scaling {scaling!r}; choose 'tensorwise' or 'rowwise'")
    if amax is None:
        amax = x.abs().amax() if scaling == "tensorwise" else x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones((), dtype=x.dtype))
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight and input are FP8-E4M3 quantize-dequantized; the matmul runs in float32.

    Emulates an FP8 GEMM (E4M3 operands, float32 accumulation, as on H100 tensor cores) on any
    device. The weight is quantized once (``fp8_e4m3_qdq``), the input at every call with a scale
    computed from that input ("dynamic"/"current" scaling). Two scalings a practitioner meets:

    - "tensorwise" (``rollout.precision=fp8_e4m3``): one scale per weight tensor and one per input
      tensor: torchao's Float8 "tensorwise" recipe, TransformerEngine's current scaling, vLLM's fp8
      with dynamic per-tensor activations. The coarser one: an outlier anywhere in the tensor
      shrinks the resolution of every other value. The input's scale is taken over the whole call,
      so a row's rounding depends on the other rows of its batch, as in a serving engine.
    - "rowwise" (``rollout.precision=fp8_e4m3_rowwise``): one scale per output channel of the
      weight and one per token of the input: torchao's "rowwise" recipe, vLLM's fp8 per-channel
      weights with per-token activations. Finer; each row independent of the batch.

    The bias (if any) stays float32, as in those recipes.

    ``last_amax`` is the input absmax of the latest call; ``reuse_scale()`` makes the next call (one
    call only) scale its input by it instead of by its own. That lets a tensorwise engine split one
    forward into several (a prompt prefilled once for its G samples, then each row's last prompt
    token) and still quantize every piece with the scale the whole forward would have taken.
    """

    def __init__(self, linear: torch.nn.Linear, scaling: str):
        super().__init__()
        self.scaling = scaling
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", fp8_e4m3_qdq(linear.weight.detach(), scaling))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.last_amax: torch.Tensor | None = None
        self._next_amax: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        amax, self._next_amax = self._next_amax, None
        if amax is None:
            amax = x.abs().amax() if self.scaling == "tensorwise" else x.abs().amax(dim=-1, keepdim=True)
        self.last_amax = amax
        return torch.nn.functional.linear(fp8_e4m3_qdq(x, self.scaling, amax), self.weight, self.bias)

    def reuse_scale(self, on: bool = True) -> None:
        """Scale the next call's input by ``last_amax`` (``on``), or cancel a pending reuse (not ``on``).

        Raises:
            ValueError: a per-row scaling (its scales are per token, not shared by a batch), or no
                call yet to take the scale from.
        """
        if not on:
            self._next_amax = None
            return
        if self.scaling != "tensorwise":
            raise ValueError("only a tensorwise Fp8Linear shares one input scale across calls; rowwise scales are per token")
        if self.last_amax is None:
            raise ValueError("reuse_scale before any call: run a forward first to take the scale from")
        self._next_amax = self.last_amax

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.scaling}"


def batch_scaled_linears(model: torch.nn.Module) -> list[Fp8Linear]:
    """The ``Fp8Linear`` s of ``model`` with one input scale per call (tensorwise): those whose rounding
    depends on which rows and positions share a forward."""
    return [m for m in model.modules() if isinstance(m, Fp8Linear) and m.scaling == "tensorwise"]


def _fp8_copy(model: torch.nn.Module, scaling: str) -> torch.nn.Module:
    """``model`` (already a float32 copy) with every nn.Linear replaced by an ``Fp8Linear``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                # a new module, not an in-place cast: a head tied to the embedding keeps the float
                # embedding (embeddings are looked up, not multiplied, in FP8 recipes)
                setattr(parent, name, Fp8Linear(child, scaling))
    return model


def behaviour_copy(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A copy of ``model`` for rollouts in ``precision``.

    ``bfloat16`` / ``float16``: weights and compute in that dtype (logits are cast to float32 by the
    engine before the log-softmax), RoPE's frequency table kept in float32 as transformers' own model of that dtype
    keeps it. ``int8``: dynamic quantization of every ``nn.Linear``
    (int8 weights, activations quantized per batch; ``torch.ao.quantization.quantize_dynamic``).
    ``fp8_e4m3`` / ``fp8_e4m3_rowwise``: every ``nn.Linear`` (the LM head included, as int8) becomes
    an ``Fp8Linear`` emulating FP8-E4M3 weights and activations with per-tensor / per-row absmax
    scaling; the rest (embeddings, norms) stays float32.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown rollout precision {precision!r}; choose one of {PRECISIONS}")
    m = copy.deepcopy(model).eval()
    if precision == "int8":
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager-mode API is deprecated in favour of torchao, not removed
            return quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
    if precision in FP8_SCALINGS:
        return _fp8_copy(m.float(), FP8_SCALINGS[precision])
    m = m.to(getattr(torch, precision))
    _rope_frequencies_in_float32(m, model)
    return m


def _rope_frequencies_in_float32(copy_: torch.nn.Module, model: torch.nn.Module) -> None:
    # Module.to casts RoPE's frequency table (inv_freq) too: rounded to bf16, a rotation angle is off by ~1 rad at
    # position 1,000 (transformers' bf16 model, and vLLM, keep the table in float32 and round only cos/sin). The
    # rotary modules compute in float32 whatever the table's dtype, so restoring it changes nothing else.
    for mine, theirs in zip(copy_.modules(), model.modules()):
        for name in mine._non_persistent_buffers_set:
            ours = theirs._buffers.get(name)
            if name.endswith("inv_freq") and ours is not None and ours.dtype == torch.float32:
                mine._buffers[name] = ours.detach().clone()
