"""Regional compilation of the learner's training forwards (``train.compile``): each decoder block's forward goes
through ``torch.compile`` (torchtune's ``compile_model`` does the same per layer), not the whole model.

Why per block: the blocks are one class with one code object, so torch compiles one graph and every layer reuses it
(parameters are graph inputs, not guarded constants), where a whole-model compile grows with depth and breaks at
the LM head's custom autograd function and the shared-prompt cache. The chunked LM head, the objective and the
optimizer stay eager.

Why only where autograd records: the learner's module is shared by the rollout engine, the held-out evaluation and
the learner's own no-grad forwards (reference, behaviour and proximal log-probs), whose shapes change at every
decode step. A block's forward is compiled only when ``torch.is_grad_enabled()``: the training forward and its
recomputation under activation checkpointing. Every no-grad forward runs the eager block, as before. So the
training forward computes what the eager forward computes up to float round-off of the fused kernels (inductor's
``emulate_precision_casts`` rounds to bf16 where eager ops would under bf16 autocast), and the on-policy ESS stays 1
to that round-off (``tests/unit/test_compile_blocks.py``).

Why not with the shared-prompt forward: it hands each block the prompt's cache, and dynamo guards on that cache's
per-layer state, so every layer would compile a graph of its own and blocks past the recompile limit (8) would run
eager. The learner with ``compile_backend`` runs the plain (or padding-free) forward instead.

Cost: the first training forward compiles (seconds on a GPU, tens of seconds for a tiny model on one CPU core), and
a second shape recompiles once with dynamic sizes; later micro-batches of other lengths reuse that graph.

Tested on the CPU in one process and under ``torchrun`` with 2 gloo ranks (FSDP2, DDP:
``tests/integration/test_compile_train.py``). Untested on a GPU (no GPU was lent to the session that wrote it):
``tests/gpu/test_learner_cuda.py`` compares it with the eager step in float32 and bf16-mixed, and
``bench/gpu_check.py``'s ``compile`` section times it beside the ``learner`` section's eager step.
"""

from __future__ import annotations

import copy

import torch

from ..parallel import decoder_blocks

BACKENDS = ("inductor", "aot_eager", "eager")


class TrainingForward:
    """A block's forward: ``eager`` (the block's own bound ``forward``) through ``torch.compile`` with ``backend`` and
    ``options`` when autograd records the call, eager otherwise (module docstring)."""

    def __init__(self, eager, backend: str, options: dict | None):
        self.eager, self.backend, self.options = eager, backend, options
        self.compiled = torch.compile(eager, backend=backend, options=options)  # lazy: compiles at its first call

    def __call__(self, *args, **kwargs):
        return (self.compiled if torch.is_grad_enabled() else self.eager)(*args, **kwargs)

    def __deepcopy__(self, memo):
        # a copied model (a snapshot, an engine's copy) must compile its own block: the compiled function holds the
        # original block, so copying it would run the original's weights
        return TrainingForward(copy.deepcopy(self.eager, memo), self.backend, self.options)


def compile_options() -> dict:
    """Inductor's options: ``emulate_precision_casts`` where this torch has it, so a fused kernel rounds to bf16
    wherever the eager ops would under the learner's bf16 autocast."""
    import torch._inductor.config as inductor

    return {"emulate_precision_casts": True} if hasattr(inductor, "emulate_precision_casts") else {}


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder block's training forward in place (module docstring); returns the number of blocks.

    ``model``: a transformers causal LM (or a peft model or DDP-style wrapper of one), before the learner wraps
    it. ``backend``: ``torch.compile``'s (``BACKENDS``; tests use ``aot_eager``, which traces without generating
    code). Calling it twice leaves the blocks compiled once.

    Raises:
        ValueError: an unknown backend, or a model without decoder blocks (``parallel.decoder_blocks``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    blocks = decoder_blocks(getattr(model, "module", model))
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no decoder blocks to compile (no _no_split_modules and no "
                         "model.layers); set train.compile=false")
    options = compile_options() if backend == "inductor" else None
    for block in blocks:
        if isinstance(block.forward, TrainingForward):
            continue
        block.forward = TrainingForward(block.forward, backend, options)
    return len(blocks)
