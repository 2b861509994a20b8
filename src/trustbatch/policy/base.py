"""The default base policy: a small Llama with a task-trained tokenizer, warmed up by SFT, cached on disk.

No model hub is reachable on the machines we target, so the default path builds its own model.
The result is cached under ``$TRUSTBATCH_CACHE`` (default ``~/.cache/trustbatch``) by a hash of
everything that determines it (``base_settings``: what the build reads, no more), and reused by later runs. The
default config's base ships with the package (``policy.shipped``), so a fresh machine finds it without building.

A reasoning-gym task's first ``task.heldout_reserve`` (256) prompts are kept from the base's SFT, whatever
``task.heldout_size``: any held-out set up to that size is prompts the base never saw, and one base serves them all
(``task.heldout_size=32`` starts from the shipped base). A larger held-out set is skipped by the SFT too, and so
builds its own base.
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

from ..data import TaskSplit, load_task
from ..errors import UserError
from ..seeding import forked_rngs
from ..records import refused_write, umask_modes
from .model import Policy, build_small_llama, load_policy
from .sft import demos_within_context, sft
from .shipped import install_shipped, shipped_base, shipped_manifests
from .tokenizer import train_tokenizer

BASE_FORMAT = 1  # bump when the recipe changes, to invalidate old caches


def cache_dir() -> Path:
    root = os.environ.get("TRUSTBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "trustbatch"
    )
    return Path(root)


# what build_base reads of a reasoning-gym task and of the model section: settings outside these lists (held-out
# evaluation, RL, LoRA, keys added later) never move the key. ``path`` is always None for a default base; it stays
# so that the keys, and the shipped base's (chain_sum-88727ec7e0e902cd), are what they were before this list.
BASE_TASK_KEYS = ("name", "params", "train_size", "heldout_size", "seed")
BASE_MODEL_KEYS = ("path", "hidden", "layers", "heads", "vocab_size", "max_len", "sft_examples", "sft_teacher_error",
                   "sft_steps", "sft_batch_size", "sft_lr", "seed")


def sft_skip(task_cfg: dict) -> int:
    """How many leading prompts of a generated task the base's SFT skips: the held-out ones, and at least
    ``task.heldout_reserve`` (a config without the key, from before it existed: the held-out ones alone)."""
    return max(task_cfg["heldout_size"], task_cfg.get("heldout_reserve", 0))


def base_settings(task_cfg: dict, model_cfg: dict) -> dict:
    """``{"format", "task", "model"}``: the settings that determine the default base, as its key hashes them.

    ``task_cfg``: ``recipes.build.task_key`` (the ``task`` section, or for data files the ``data`` section less the
    prompt format, all of which the split of the files reads); ``model_cfg``: the ``model`` section as a dict. A
    reasoning-gym task's ``heldout_size`` enters as ``sft_skip``, the prompts the SFT skips (``heldout_reserve``
    itself does not: a reserve below the held-out size changes nothing).
    """
    if "train" in task_cfg:  # data files: which rows train depends on every data setting left in task_key
        task = dict(task_cfg)
    else:
        task = {k: task_cfg[k] for k in BASE_TASK_KEYS} | {"heldout_size": sft_skip(task_cfg)}
    return {"format": BASE_FORMAT, "task": task, "model": {k: model_cfg[k] for k in BASE_MODEL_KEYS}}


def base_key(task_cfg: dict, model_cfg: dict) -> str:
    """The default base's cache key: the first 16 hex digits of the sha256 of ``base_settings`` as sorted-key JSON."""
    blob = json.dumps(base_settings(task_cfg, model_cfg), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sft_split(task: TaskSplit, task_cfg: dict) -> TaskSplit:
    """The split whose train prompts the base's SFT reads: ``task`` itself, or for a reasoning-gym task held out on
    fewer than ``task.heldout_reserve`` prompts, the task generated again with that many held out (the same prompt
    sequence: reasoning-gym draws each item from the seed and its index)."""
    skip = None if "train" in task_cfg else sft_skip(task_cfg)
    if skip is None or skip == task_cfg["heldout_size"]:
        return task
    try:
        return load_task(task_cfg["name"], train_size=task_cfg["train_size"], heldout_size=skip,
                         seed=task_cfg["seed"], params=task_cfg["params"])
    except UserError:
        raise UserError(f"task {task_cfg['name']!r} with {task_cfg['params']} has too few distinct prompts for the "
                        f"default base, whose SFT skips the first {skip} (so that it never trains on a held-out "
                        "prompt); widen task.params, lower task.heldout_reserve or give model.path") from None


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


def sft_demos(task: TaskSplit, model_cfg: dict, chat: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
    """(prompt, completion) pairs for the SFT warm-up: the first ``sft_examples`` train prompts, with a
    ``sft_teacher_error`` fraction of answers replaced by ``weak_teacher``.

    A plain-text prompt's completion starts with a space (the prompt ends a sentence); after a chat template's
    assistant header (``chat(prompt)``: ``Policy.frames``; None: no prompt is) the answer starts at once, as the
    template renders an assistant turn and as TRL's SFT keeps a conversational completion."""
    n = model_cfg.get("sft_examples") or len(task.train)
    demos = [(e.prompt, ("" if chat is not None and chat(e.prompt) else " ") + e.answer) for e in task.train[:n]]
    return weak_teacher(demos, model_cfg.get("sft_teacher_error", 0.0), seed=model_cfg["seed"])


def _within_context(policy: Policy, demos: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The demonstrations that fit the base's ``model.max_len`` positions (``sft.demos_within_context``), as
    ``recipes.build.fit_demos`` keeps them for ``model.path``: past them the SFT trains positions no rollout reaches
    (a data file's prompts longer than the context are then all refused by the run).

    Raises:
        UserError: none fits, before any SFT step (names ``model.max_len``).
    """
    keep, lengths, max_len = demos_within_context(policy, demos)
    if demos and not keep:
        raise UserError(f"none of the {len(demos)} SFT demonstrations of the default base fits its context of "
                        f"model.max_len={max_len} tokens (the shortest prompt and answer have {min(lengths)}); raise "
                        f"model.max_len (e.g. model.max_len={1 << (2 * min(lengths) - 1).bit_length()}), or give a "
                        "model with model.path")
    return keep


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
    moved = moved_settings(base_settings(task_cfg, model_cfg), shipped_manifests(task_name))
    return None, (f"no base for these task and model settings (key {key}) is cached in {final.parent}, and {why_not}"
                  + (f"; the shipped {task_name} base was built with other {', '.join(moved)}" if moved else ""))


def moved_settings(settings: dict, manifests: list[dict]) -> list[str]:
    """The settings (``task.heldout_size (256 -> 512)``, dotted, in key order) in which ``settings``
    (``base_settings``) differ from the nearest of the shipped bases' ``manifests``; [] when none ships."""
    best: list[str] | None = None
    for m in manifests:
        diff = [f"{section}.{k} ({m.get(section, {}).get(k)!r} -> {settings[section].get(k)!r})"
                for section in ("task", "model")
                for k in sorted(set(settings[section]) | set(m.get(section, {})))
                if settings[section].get(k) != m.get(section, {}).get(k)]
        if best is None or len(diff) < len(best):
            best = diff
    return best or []


def build_base(
    task: TaskSplit, task_cfg: dict, model_cfg: dict, on_step: Callable[[int, float], None] | None = None
) -> Path:
    """Build the base of these settings (tokenizer, small Llama, ``model_cfg["sft_steps"]`` SFT steps) and cache
    it; returns its folder. ``on_step(step, loss)`` hears each SFT step (0-based, token-mean NLL in nats).

    model_cfg keys: hidden, layers, heads, vocab_size, max_len, sft_examples, sft_teacher_error, sft_steps,
    sft_batch_size, sft_lr, seed.
    The tokenizer and the SFT read the train prompts of ``sft_split``. The directory is written to a temporary
    sibling and renamed, so a crash never leaves half a model.
    """
    final = base_folder(task.name, task_cfg, model_cfg)
    task = sft_split(task, task_cfg)
    texts = [e.prompt for e in task.train] + [" " + e.answer for e in task.train]
    tok = train_tokenizer(texts, vocab_size=model_cfg["vocab_size"])
    # the build seeds torch's generators (its own seed): a run that builds a base after seeding itself (the foreign
    # model's) must draw its own streams afterwards, as a run that found the base cached does
    with forked_rngs():
        model = build_small_llama(
            len(tok), hidden=model_cfg["hidden"], layers=model_cfg["layers"], heads=model_cfg["heads"],
            max_len=model_cfg["max_len"], seed=model_cfg["seed"], tokenizer=tok,
        )
        policy = Policy(model=model, tokenizer=tok, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        demos = _within_context(policy, sft_demos(task, model_cfg))
        sft(policy, demos, steps=model_cfg["sft_steps"], batch_size=model_cfg["sft_batch_size"],
            lr=model_cfg["sft_lr"], seed=model_cfg["seed"], on_step=on_step)
    # the nearest folder that exists: a missing parent that cannot be made (a read-only home) is the cache's refusal
    made = next(p for p in (final.parent, *final.parent.parents) if p.exists())
    with refused_write(made, f"the base into the cache {str(final.parent)!r}",
                       "free disk space there, or set TRUSTBATCH_CACHE to a folder you can write"):
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
        except BaseException:  # a Ctrl-C, SIGTERM or a refused write mid-save: no half-written folder in the cache
            shutil.rmtree(tmp, ignore_errors=True)
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
