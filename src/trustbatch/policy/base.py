"""The default base policy: a small Llama with a task-trained tokenizer, warmed up by SFT, cached on disk.

No model hub is reachable on the machines we target, so the default path builds its own model.
The result is cached under ``$TRUSTBATCH_CACHE`` (default ``~/.cache/trustbatch``) by a hash of
everything that determines it, and reused by later runs. The default config's base ships with the package
(``policy.shipped``), so a fresh machine finds it without building.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..data import TaskSplit
from ..records import umask_modes
from .model import Policy, build_small_llama, load_policy
from .sft import sft
from .shipped import install_shipped, shipped_base
from .tokenizer import train_tokenizer

BASE_FORMAT = 1  # bump when the recipe changes, to invalidate old caches


def cache_dir() -> Path:
    root = os.environ.get("TRUSTBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "trustbatch"
    )
    return Path(root)


# model settings that act on top of the base and do not determine it: a LoRA run trains adapters on the
# same cached base as full fine-tuning (and the key stays what it was before the setting existed)
NOT_BASE_KEYS = ("lora",)


def base_key(task_cfg: dict, model_cfg: dict) -> str:
    model_cfg = {k: v for k, v in model_cfg.items() if k not in NOT_BASE_KEYS}
    blob = json.dumps({"format": BASE_FORMAT, "task": task_cfg, "model": model_cfg}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weak_teacher(demos: list[tuple[str, str]], error: float, seed: int) -> list[tuple[str, str]]:
    """Replace the answer of a fixed fraction ``error`` of demonstrations by another demonstration's answer.

    This simulates warm-up data from an imperfect teacher (distillation from a weaker model, unverified
    human answers), the usual starting point of RL with a verifier: the wrong answers follow the task's
    own answer distribution, so they are plausible, and each demonstration is corrupted once, not per epoch.
    """
    if error <= 0:
        return demos
    rng = random.Random(seed + 7919)
    answers = [c for _, c in demos]
    return [(p, rng.choice(answers) if rng.random() < error else c) for p, c in demos]


def sft_demos(task: TaskSplit, model_cfg: dict) -> list[tuple[str, str]]:
    """(prompt, completion) pairs for the SFT warm-up: the first ``sft_examples`` train prompts, with a
    ``sft_teacher_error`` fraction of answers replaced by ``weak_teacher``."""
    n = model_cfg.get("sft_examples") or len(task.train)
    demos = [(e.prompt, " " + e.answer) for e in task.train[:n]]
    return weak_teacher(demos, model_cfg.get("sft_teacher_error", 0.0), seed=model_cfg["seed"])


def base_folder(task_name: str, task_cfg: dict, model_cfg: dict) -> Path:
    """Where the cache keeps the base of these task and model settings: ``cache_dir()/base/{task}-{key}``."""
    return cache_dir() / "base" / f"{task_name}-{base_key(task_cfg, model_cfg)}"


def find_base(task_name: str, task_cfg: dict, model_cfg: dict) -> tuple[Path | None, str]:
    """``(folder, how)`` of an existing base for these settings, or ``(None, why one must be built)``.

    Looked up in the cache first (``how`` = ``"cached"``), then among the bases shipped with the package
    (``policy.shipped``: the key and every file's sha256 checked; ``how`` = ``"shipped"``, copied into the cache).
    """
    key = base_key(task_cfg, model_cfg)
    final = cache_dir() / "base" / f"{task_name}-{key}"
    if (final / "config.json").exists():
        return final, "cached"
    src, why_not = shipped_base(task_name, key)
    if src is not None:
        return install_shipped(src, final), "shipped"
    return None, f"no base for these task and model settings (key {key}) is cached in {final.parent}, and {why_not}"


def build_base(
    task: TaskSplit, task_cfg: dict, model_cfg: dict, on_step: Callable[[int, float], None] | None = None
) -> Path:
    """Build the base of these settings (tokenizer, small Llama, ``model_cfg["sft_steps"]`` SFT steps) and cache
    it; returns its folder. ``on_step(step, loss)`` hears each SFT step (0-based, token-mean NLL in nats).

    model_cfg keys: hidden, layers, heads, vocab_size, max_len, sft_examples, sft_teacher_error, sft_steps,
    sft_batch_size, sft_lr, seed.
    The directory is written to a temporary sibling and renamed, so a crash never leaves half a model.
    """
    final = base_folder(task.name, task_cfg, model_cfg)
    texts = [e.prompt for e in task.train] + [" " + e.answer for e in task.train]
    tok = train_tokenizer(texts, vocab_size=model_cfg["vocab_size"])
    model = build_small_llama(
        len(tok), hidden=model_cfg["hidden"], layers=model_cfg["layers"], heads=model_cfg["heads"],
        max_len=model_cfg["max_len"], seed=model_cfg["seed"], tokenizer=tok,
    )
    policy = Policy(model=model, tokenizer=tok, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    sft(
        policy, sft_demos(task, model_cfg), steps=model_cfg["sft_steps"],
        batch_size=model_cfg["sft_batch_size"], lr=model_cfg["sft_lr"], seed=model_cfg["seed"], on_step=on_step,
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        policy.save(tmp)
        umask_modes(tmp)
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").exists():
            raise
    return final


def default_base(
    task: TaskSplit, task_cfg: dict, model_cfg: dict, on_step: Callable[[int, float], None] | None = None
) -> tuple[Policy, Path, str]:
    """Return (policy, directory, how): the base of these settings, found (``find_base``: ``"cached"`` or
    ``"shipped"``) or else built now (``build_base``: ``"built now"``)."""
    path, how = find_base(task.name, task_cfg, model_cfg)
    if path is None:
        path, how = build_base(task, task_cfg, model_cfg, on_step), "built now"
    return load_policy(path), path, how
