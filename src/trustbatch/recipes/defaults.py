"""Defaults that depend on the data: a completion budget that fits the benchmark's answers.

``rollout.max_new_tokens`` defaults to 8 tokens, the default task's few-digit answers. GSM8K, MATH, AIME, AMC and
Countdown answers need hundreds to thousands of tokens: cut at 8 every completion is truncated and every reward is 0. When the
user did not set ``rollout.max_new_tokens``, a run on one of them gets ``data.benchmarks.ANSWER_TOKENS`` (the peers'
budgets), at most half the model's context so that the prompt keeps the other half.
"""

from __future__ import annotations

import json

from ..config import Config
from ..data.benchmarks import ANSWER_TOKENS, benchmark_kind
from ..errors import UserError
from ..policy.hub import model_dir

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def model_context(cfg: Config) -> int | None:
    """The positions of ``model.path`` (its ``config.json``), or ``model.max_len`` for the default base; None when
    the model's config does not say."""
    if cfg.model.path is None:
        return cfg.model.max_len
    try:
        mc = json.loads((model_dir(cfg.model.path, cfg.model.revision) / "config.json").read_text())
    except (OSError, ValueError, UserError):
        return None  # loading the model says why
    mc = {**mc.get("text_config", {}), **mc} if isinstance(mc.get("text_config"), dict) else mc
    return next((int(mc[k]) for k in _CONTEXT_KEYS if isinstance(mc.get(k), int)), None)


def with_answer_budget(cfg: Config) -> tuple[Config, str | None]:
    """``cfg`` with ``rollout.max_new_tokens`` fitted to the training data's benchmark, and a line saying so; or
    ``(cfg, None)`` unchanged: the user set the key, the data is the reasoning-gym task, or no known benchmark.

    The budget: ``ANSWER_TOKENS[kind]`` (gsm8k 512, math and countdown 1024, aime and amc 20480), at most half of
    ``model_context(cfg)``.
    """
    if not cfg.data.train or "max_new_tokens" in cfg.rollout.model_fields_set:
        return cfg, None
    kind = benchmark_kind(cfg.data.train, cfg.data.dir, cfg.data.format)
    if kind is None:
        return cfg, None
    budget, context = ANSWER_TOKENS[kind], model_context(cfg)
    capped = context is not None and context // 2 < budget
    if capped:
        budget = max(1, context // 2)
    rollout = cfg.rollout.model_copy(update={"max_new_tokens": budget})
    why = f"half the model's {context}-token context" if capped else f"the completion budget that fits {kind} answers"
    return cfg.model_copy(update={"rollout": rollout}), (
        f"rollout.max_new_tokens={budget} ({why}; the default of 8 would cut every answer): set "
        f"rollout.max_new_tokens to choose another")
