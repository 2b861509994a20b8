"""Memory budgets in tokens × V (scale-up design, invariant 7): how many positions one LM-head chunk or one
generate call may hold, derived from the vocabulary size V and the model's key/value width.

A ``[tokens, V]`` float32 tensor takes tokens · V · 4 bytes, whatever split of rows and columns makes up the
tokens; so the learner's LM-head chunks and the engine's generate batches are bounded in tokens, not columns
or rows. Budgets:

- ``LOGITS_BYTES`` = 2^28 bytes (256 MiB) of float32 logits per ``[tokens, V]`` tensor: at V = 151,936,
  ``logit_tokens`` = ⌊2^28 / (4 · 151,936)⌋ = 441 tokens; at V = 304 (the default job), 220,752.
- ``KV_BYTES`` = 2^32 bytes (4 GiB) of key/value cache per generate call: rows · (prompt + new tokens) ·
  ``kv_bytes_per_token``.
- The recorded behaviour distribution (kl="exact" with a rollout precision other than float32,
  ``rollout.spec.behaviour_distribution`` "recorded"): one round's N rows · steps · V float32, held twice at its
  peak (the rollouts' rows beside the built batch; the batch beside a mini-batch's rows, which the learner selects
  by copying; three times packed or with rows of several behaviour models, ``held_copies``), in one ``[tokens, V]``
  budget, ``LOGITS_BYTES`` (``recorded_fits``): at V = 151,936, 220 tokens (e.g. 27 rows of 8); at V = 304,
  110,376 (the lab's 512 rows of up to 32 steps take 19,922,944 bytes).

A chunk or call holds several tensors of its size at once (logits, log-softmax, their gradient), so the
process's peak is a small multiple of the budget, not the budget.
"""

from __future__ import annotations

import torch

LOGITS_BYTES = 2**28
KV_BYTES = 2**32
FLOAT32_BYTES = 4


def logit_tokens(vocab: int, budget_bytes: int = LOGITS_BYTES) -> int:
    """The most positions whose float32 logits ``[tokens, V]`` fit in ``budget_bytes``: ⌊budget / (4 · V)⌋, at
    least 1 (a single position over the budget is still computed). Raises ValueError for V < 1."""
    if vocab < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab}")
    return max(1, budget_bytes // (FLOAT32_BYTES * vocab))


def recorded_bytes(rows: int, steps: int, vocab: int) -> int:
    """Bytes of ``rows`` · ``steps`` · ``vocab`` float32: one round's recorded distributions [N, steps, V]."""
    return rows * steps * vocab * FLOAT32_BYTES


def recorded_fits(rows: int, steps: int, vocab: int, budget_bytes: int = LOGITS_BYTES, copies: int = 2) -> bool:
    """Whether one round's recorded distributions fit ``budget_bytes`` held ``copies`` times (``copies`` ·
    ``recorded_bytes`` ≤ budget): the round's rows beside its batch while the batch is built, the batch beside a
    mini-batch's copy while the learner trains (the reviewer's: a 102 MB record failed under a 70 MB allowance,
    trained under 180 MB); three where the learner copies it once more (``held_copies``)."""
    return copies * recorded_bytes(rows, steps, vocab) <= budget_bytes


def held_copies(padding_free: bool, mixed_versions: bool) -> int:
    """How many copies of the recorded distributions the learner holds at its peak: 2, and 3 where it copies the
    mini-batch's record once more: at the packed positions (``padding_free``: ``TeacherForced.at``), or the rows of
    one behaviour model among several (``mixed_versions``, e.g. foreign samples: ``passes`` selects them). A
    reviewer measured 2,025 MiB over the base padded, 3,259 packed, 2,975 with a quarter foreign rows, for a
    1,187 MiB record."""
    return 3 if padding_free or mixed_versions else 2


def vocab_size(model: torch.nn.Module) -> int:
    """V: the output embedding's rows (its ``out_features``; global under FSDP2), else ``config.vocab_size``.

    Raises ValueError when the model states neither."""
    m = getattr(model, "module", model)  # a DDP wrapper
    try:
        head = m.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if isinstance(head, torch.nn.Linear):
        return int(head.out_features)
    cfg = getattr(m, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    v = getattr(cfg, "vocab_size", None)
    if not v:
        raise ValueError(f"{type(m).__name__} has no output embedding or config.vocab_size: cannot size its chunks")
    return int(v)


def kv_bytes_per_token(model: torch.nn.Module) -> int | None:
    """Bytes of key/value cache one position takes: 2 · layers · KV heads · head dim · the weights' element size
    (a bf16 autocast cache takes half of a float32 model's, so this bounds it). None when the config does not
    state the shape (the generate batch is then bounded by the logits alone)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    layers, heads = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    elem = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * elem


def generate_rows(model: torch.nn.Module, seq_len: int, *, max_rows: int, logits_bytes: int = LOGITS_BYTES,
                  kv_bytes: int = KV_BYTES) -> int:
    """Sequences per generate call: at most ``max_rows``, ``logit_tokens(V)`` (one decoding step's ``[rows, V]``
    scores) and ``kv_bytes`` / (``seq_len`` · ``kv_bytes_per_token``) (the cache of ``seq_len`` = prompt + new
    tokens per row); at least 1."""
    rows = min(max_rows, logit_tokens(vocab_size(model), logits_bytes))
    per_token = kv_bytes_per_token(model)
    if per_token:
        rows = min(rows, kv_bytes // (max(1, seq_len) * per_token))
    return max(1, rows)
