"""How much bf16-mixed should move a gradient: bf16's unit round-off times the gradient's measured amplification.

bf16 keeps 8 significant bits, so rounding a value to bf16 changes it by a relative amount of at most u = 2^-8.
Under bf16 autocast the operands of the matrix products (``F.linear``, ``matmul``, ``bmm``, attention), their
outputs and, in the backward, the gradients through them are rounded so. ``Jitter`` models that to first order
in float64: each such tensor is multiplied by 1 + η·ε with ε uniform in [−1, 1], drawn afresh for every tensor
(forward values, and gradients in the backward). The amplification κ of a gradient g is its relative change per
unit η, ‖g_jittered − g‖ / (‖g‖ · η), averaged over draws. bf16-mixed's relative gradient error should then be
about u·κ: a model- and batch-specific number (a trained model, whose sharp distributions amplify more, has a
larger κ than a random one), measured rather than assumed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

U_BF16 = 2.0**-8

_PRODUCTS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
             F.scaled_dot_product_attention}


class _Jitter(torch.autograd.Function):
    """x · (1 + η·ε) forward; the gradient gets the same factor and one more of its own (its own rounding)."""

    @staticmethod
    def forward(ctx, x, eta: float, gen: torch.Generator):
        f = 1 + eta * (2 * torch.rand(x.shape, generator=gen, dtype=x.dtype) - 1)
        ctx.eta, ctx.gen = eta, gen
        ctx.save_for_backward(f)
        return x * f

    @staticmethod
    def backward(ctx, g):
        (f,) = ctx.saved_tensors
        own = 1 + ctx.eta * (2 * torch.rand(g.shape, generator=ctx.gen, dtype=g.dtype) - 1)
        return g * f * own, None, None


class Jitter(TorchFunctionMode):
    """Within it, every matrix product's floating operands and output are jittered by η (module docstring)."""

    def __init__(self, eta: float, seed: int):
        super().__init__()
        self.eta, self.gen = eta, torch.Generator().manual_seed(seed)

    def _j(self, t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return _Jitter.apply(t, self.eta, self.gen)
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _PRODUCTS:
            return func(*args, **kwargs)
        kw = {k: (v if k == "attn_mask" else self._j(v)) for k, v in kwargs.items()}
        return self._j(func(*[self._j(a) for a in args], **kw))


def amplification(grads: Callable[[TorchFunctionMode | None], torch.Tensor], eta: float = U_BF16,
                  draws: int = 3, seed: int = 0) -> float:
    """κ: the mean over ``draws`` of ‖grads(Jitter(η)) − grads(None)‖ / (‖grads(None)‖ · η).

    ``grads(mode)`` returns a flat float64 gradient computed with ``mode`` entered (None: without one)."""
    g0 = grads(None)
    rel = [float((grads(Jitter(eta, seed + i)) - g0).norm() / g0.norm()) for i in range(draws)]
    return sum(rel) / len(rel) / eta
