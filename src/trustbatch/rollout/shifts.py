"""Behaviour-policy shifts for the off-policy lab: lower precision (staleness is ``pipeline.weight_sync.LaggedSync``).

Each shift changes only the rollout side; the learner always trains the float32 policy at T = 1.
The behaviour log-probs recorded by the engine are those of the distribution actually sampled from,
so the ratio π_θ/μ that the objectives see measures exactly the shift.
(Temperature is a sampling argument of the engine itself; replay is ``train.epochs``/``minibatches``.)
"""

from __future__ import annotations

import copy
import warnings

import torch

PRECISIONS = ("float32", "bfloat16", "float16", "int8")


def behaviour_copy(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A copy of ``model`` for rollouts in ``precision``.

    ``bfloat16`` / ``float16``: weights and compute in that dtype (logits are cast to float32 by the
    engine before the log-softmax). ``int8``: dynamic quantization of every ``nn.Linear``
    (int8 weights, activations quantized per batch; ``torch.ao.quantization.quantize_dynamic``),
    the CPU analogue of FP8 rollouts.

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
    return m.to(getattr(torch, precision))
