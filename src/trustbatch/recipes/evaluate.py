"""``trustbatch eval`` as a recipe: pass@k of a local model on benchmarks, with the training engines and reward pool.

``evaluate`` checks every option before the model loads (one-line ``UserError``), loads the benchmarks and the model,
builds the engine and runs ``eval.benchmarks.evaluate_benchmarks``; it returns the results dict that
``save_results`` writes as JSON. The CLI command parses options, calls these and prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Callable, Sequence

from ..errors import UserError
from .build import check_answer_scorers, questions_warning


def parse_ks(k: str, n: int) -> list[int]:
    """The sorted distinct k of a comma-separated ``-k`` option (``"1,2,4"``), each checked against n.

    Raises:
        UserError: ``k`` is not comma-separated integers, or some k is outside 1..n.
    """
    try:
        ks = sorted({int(x) for x in k.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"-k {k!r} must be comma-separated integers, e.g. -k 1,2,4") from None
    _check_ks(n, ks, k)
    return ks


def _check_ks(n: int, ks: Sequence[int], shown: str) -> None:
    if n < 1 or not ks or min(ks) < 1 or max(ks) > n:
        raise UserError(f"need 1 <= k <= n for every k; got n={n}, k={shown!r} (raise -n or lower -k)")


def evaluate(model: str | Path, benchmarks: Sequence[str], *, n: int = 16, ks: Sequence[int] = (1, 2, 4, 8, 16),
             temperature: float = 1.0, max_new_tokens: int | None = None, limit: int | None = None,
             data_dir: str | None = None, reward: str | None = None, fmt: str = "auto",
             prompt_field: str | None = None, answer_field: str | None = None, workers: int = 2,
             timeout: float = 10.0, seed: int = 0, engine: str = "transformers", device: str = "auto",
             decode: str = "dynamic", noise: str = "generator", precision: str = "float32", chat_template: str = "auto",
             system_prompt: str | None = None,
             max_prompt_tokens: int | None = None, long_prompts: str = "skip", progress=None,
             warn: Callable[[str], None] | None = None, prompt_column: bool = True) -> dict:
    """Sample ``n`` completions per prompt of each benchmark from ``model`` and return pass@k for every k in ``ks``.

    ``model``: a local Hugging Face model directory; ``max_new_tokens`` None: 512, or half its context if less (as
    training caps its default). ``benchmarks``: names (gsm8k, math500, aime2024, amc2023,
    countdown, resolved under ``data_dir`` or $TRUSTBATCH_DATA), JSONL, JSON or Parquet files, saved ``datasets``
    directories, or ``hf:PATH:SPLIT``. ``reward``
    overrides each benchmark's reward; ``workers`` reward processes (0: in-process, no time limit) score each
    completion within ``timeout`` seconds. ``engine``: transformers (on ``device``: auto, cpu, cuda or cuda:N) or
    vllm; ``decode`` and ``noise``: the transformers engine's decoding loop and random streams, as ``rollout.decode``
    and ``rollout.noise`` (``static_compiled`` with ``philox`` is the fast loop on a GPU); ``precision``: float32, or
    bf16-mixed (the transformers engine under bf16 autocast, as a bf16-mixed run's held-out evaluation samples). ``chat_template`` (auto, on, off) and ``system_prompt`` frame the prompts as in training
    (``Policy.set_prompt_format``); ``max_prompt_tokens`` and ``long_prompts`` limit them as ``data.max_prompt_tokens``
    and ``data.long_prompts`` do in training (skip, or keep the last tokens), so a run's held-out evaluation is
    sampled again on the same prompts (the model card's command); ``prompt_column`` reads a GSM8K, MATH or Countdown
    row's prompt column as ``data.prompt_column`` does, falling back to its question where the model cannot frame its
    chat messages, as training does. ``progress``: a rich Progress, entered only while sampling; ``warn(message)``
    hears of the prompts skipped because they and ``max_new_tokens`` exceed the model's context
    (``data.benchmarks.fit_prompts``, as training skips them; counted in each benchmark's ``prompts_skipped``), and
    of a scorer that failed or returned a reward outside [0, 1] (``eval.benchmarks.evaluate_benchmarks``).

    Returns ``{"model", "engine", "decode", "noise", "precision", "n", "k", "temperature", "max_new_tokens", "seed", "limit", "benchmarks",
    "average"}``; per benchmark and on average ``pass@k`` and its standard error ``pass@k_se`` over prompts (the
    unbiased estimator of Chen et al. 2021, arXiv 2107.03374, Eq. 1; see ``eval.benchmarks``). A standard error
    from one prompt is NaN (``save_results`` writes it as null). Each benchmark also counts ``prompts_skipped``
    (too long for the context) and ``reward_clamped`` (rewards outside [0, 1]).

    Raises:
        UserError: a k outside 1..n, a non-positive temperature or timeout, ``max_new_tokens``, ``limit`` or
            ``max_prompt_tokens`` < 1, ``long_prompts`` other than skip or truncate (truncate needs a limit),
            ``workers`` < 0, an unknown engine, reward, device, decode, noise or precision (or any set for vLLM), a benchmark that cannot be found or read, a
            benchmark none of whose prompts fits the model's context with ``max_new_tokens``, a chat template
            asked of a tokenizer without one, or vLLM missing or refusing the model.
    """
    import torch

    from ..data.benchmarks import NO_SCORER, load_benchmark
    from ..eval.benchmarks import evaluate_benchmarks
    from ..policy import load_policy
    from ..rewards import RewardPool
    from ..rollout.spec import EngineSpec

    ks = sorted(set(ks))
    spec = EngineSpec(name=engine, seed=seed, decode=decode, noise=noise)
    _check_prompt_limit(max_prompt_tokens, long_prompts)
    autocast = _autocast(precision, spec)
    dev = _checked_device(n, ks, temperature, 1 if max_new_tokens is None else max_new_tokens, limit, timeout,
                          workers, spec, reward, device)
    benches = _distinct_names([load_benchmark(b, data_dir=data_dir, format=fmt, prompt_field=prompt_field,
                                              answer_field=answer_field, limit=limit, prompt_column=prompt_column)
                              for b in benchmarks], benchmarks)
    for b in benches:
        if reward is None and b.reward == NO_SCORER:
            raise UserError(f"benchmark {b.name!r} has prompts and no answers (data format prompts), so it has no "
                            "scorer of its own; give --reward module:function, or name its answer field "
                            "(--answer-field)")
        if reward is not None:
            check_answer_scorers([reward], b.reward, other=None)
    policy = load_policy(model, key="--model")
    policy.set_prompt_format(chat_template, system_prompt, keys=("--chat-template", "--system-prompt"))
    benches = _limit_prompt_tokens(_questions(benches, policy, warn), policy, max_prompt_tokens, long_prompts, warn)
    ctx = getattr(policy.model.config, "max_position_embeddings", None)
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, ctx // 2 if ctx else DEFAULT_MAX_NEW_TOKENS)
    benches, skipped = _fit_to_context(benches, policy, ctx, max_new_tokens, warn)
    torch.manual_seed(seed)
    eng = _make_engine(spec, model, policy, dev, ctx, benches, max_new_tokens, autocast)
    with progress if progress is not None else contextlib.nullcontext():
        res = evaluate_benchmarks(policy, eng, benches,
                                  lambda r: RewardPool(reward or r, workers=workers, timeout_s=timeout),
                                  n=n, ks=ks, temperature=temperature, max_new_tokens=max_new_tokens, progress=progress,
                                  warn=warn)
    for name, k in skipped.items():
        res["benchmarks"][name]["prompts_skipped"] = k
    return {"model": str(model), "engine": engine, "decode": decode, "noise": noise, "precision": precision, "n": n,
            "k": ks, "temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed, "limit": limit,
            "max_prompt_tokens": max_prompt_tokens, "long_prompts": long_prompts, **res}


def _questions(benches: list, policy, warn: Callable[[str], None] | None) -> list:
    """``benches`` with each chat-message prompt column back to its format's question where ``policy`` cannot frame
    chat messages (``data.benchmarks.questions_in_place``), as a training run's held-out evaluation prompts them."""
    from ..data.benchmarks import questions_in_place

    if policy.frames_messages:
        return benches
    out, swapped = [], 0
    for b in benches:
        examples, n = questions_in_place(b.examples)
        out.append(dataclasses.replace(b, examples=examples))
        swapped += n
    if swapped and warn is not None:
        warn(questions_warning(swapped, "--chat-template"))
    return out


def _distinct_names(benches: list, given: list[str]) -> list:
    """``benches`` with names that key the results apart: two that would share one (``d/train`` and ``d/test``, or
    ``gsm8k`` and ``data/gsm8k/test.jsonl``) are named as given instead.

    Raises:
        UserError: one benchmark given twice.
    """
    names = [b.name for b in benches]
    for b, arg in zip(benches, given):
        if names.count(b.name) > 1:
            b.name = arg
    seen = [b.name for b in benches]
    twice = next((n for n in seen if seen.count(n) > 1), None)
    if twice is not None:
        raise UserError(f"benchmark {twice!r} is given twice (-b); give each benchmark once")
    return benches


DEFAULT_MAX_NEW_TOKENS = 512

# the engine checks name the training keys; the same settings are options here
_OPTION_NAMES = (("rollout.engine=", "--engine "), ("rollout.decode=", "--decode "), ("rollout.noise=", "--noise "),
                 ("rollout.decode", "--decode"), ("rollout.noise", "--noise"))


def _checked_device(n, ks, temperature, max_new_tokens, limit, timeout, workers, spec, reward, device):
    """Every option checked before anything loads (``evaluate``'s Raises); the torch device ``device`` names."""
    from ..parallel import DEVICE_SPEC, resolve_device
    from ..rewards import get
    from ..rollout.spec import check_engine, check_temperature, engine_names

    _check_ks(n, ks, ",".join(map(str, ks)))
    bad = [f"{name} must be {rule} (got {value})" for name, value, rule, ok in (
        ("--temperature", temperature, "a finite number > 0 (pass@k is over samples)",
         math.isfinite(temperature) and temperature > 0),
        ("--max-new-tokens", max_new_tokens, ">= 1", max_new_tokens >= 1),
        ("--limit", limit, ">= 1", limit is None or limit >= 1),
        ("--timeout", timeout, "> 0", timeout > 0),
        ("--workers", workers, ">= 0", workers >= 0)) if not ok]
    if bad:
        raise UserError("; ".join(bad))
    if spec.name not in engine_names():
        raise UserError(f"--engine {spec.name!r} must be {' or '.join(engine_names())}")
    try:
        check_engine(spec)  # vLLM not installed, or a loop it does not run, fails before anything loads
    except UserError as e:
        message = str(e)
        for key, option in _OPTION_NAMES:
            message = message.replace(key, option)
        raise UserError(message) from None
    check_temperature(spec, temperature, "--temperature")
    if reward is not None:
        get(reward)  # an unknown reward fails before the model loads
    if not re.fullmatch(DEVICE_SPEC, device):
        raise UserError(f"--device {device!r} must be auto, cpu, cuda or cuda:N")
    try:
        return resolve_device(device)
    except ValueError as e:
        raise UserError(str(e).replace("train.device", "--device")) from None


def _check_prompt_limit(max_tokens: int | None, mode: str) -> None:
    """Refuse a prompt limit below 1 or an unknown mode, or truncation without a limit (UserError, one line)."""
    if mode not in ("skip", "truncate"):
        raise UserError(f"--long-prompts must be skip or truncate (got {mode!r})")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-prompt-tokens must be >= 1 (got {max_tokens})")
    if mode == "truncate" and max_tokens is None:
        raise UserError("--long-prompts truncate needs --max-prompt-tokens N (the tokens a prompt keeps)")


def _limit_prompt_tokens(benches, policy, max_tokens: int | None, mode: str, warn):
    """Each benchmark's prompts over ``max_tokens`` skipped, or left-truncated (``policy.max_prompt_tokens``, which
    every later ``encode_prompt`` applies), as ``recipes.build.limit_prompt_length`` does in training.

    Raises:
        UserError: skipping leaves a benchmark without prompts.
    """
    import dataclasses

    from ..data.benchmarks import limit_prompts

    if max_tokens is None:
        return benches
    out = []
    for b in benches:
        ids = [policy.encode_prompt(e.prompt) for e in b.examples]
        keep, _, truncated = limit_prompts(ids, max_tokens, mode)
        if not keep:
            raise UserError(f"{b.name}: --max-prompt-tokens {max_tokens}: none of its {len(ids)} prompts fits (the "
                            f"shortest has {min(map(len, ids))} tokens); raise it, or give --long-prompts truncate")
        changed = len(ids) - len(keep) if mode == "skip" else len(truncated)
        if changed and warn is not None:
            verb = "skipped" if mode == "skip" else f"kept the last {max_tokens} tokens of"
            warn(f"{b.name}: {verb} {changed} of {len(ids)} prompts longer than {max_tokens} tokens "
                 f"(--max-prompt-tokens, --long-prompts {mode})")
        out.append(dataclasses.replace(b, examples=[b.examples[i] for i in keep]))
    if mode == "truncate":
        policy.max_prompt_tokens = max_tokens
    return out


def _fit_to_context(benches, policy, ctx, max_new_tokens, warn):
    """Each benchmark without the prompts that leave no room for ``max_new_tokens`` in the model's context ``ctx``
    (past it the model runs on positions it was never trained on, and the transformers engine pads every row of a
    batch to the longest), and the count skipped per benchmark.

    Raises:
        UserError: no prompt of a benchmark fits, or ``max_new_tokens`` alone fills the context.
    """
    import dataclasses

    from ..data.benchmarks import fit_prompts

    fitted, skipped = [], {}
    for b in benches:
        keep, warning = fit_prompts([len(policy.encode_prompt(e.prompt)) for e in b.examples], context=ctx,
                                    max_new_tokens=max_new_tokens, where=b.name)
        skipped[b.name] = len(b.examples) - len(keep)
        fitted.append(dataclasses.replace(b, examples=[b.examples[i] for i in keep]) if warning else b)
        if warning and warn is not None:
            warn(warning.removeprefix("warning: "))
    return fitted, skipped


def _autocast(precision: str, spec):
    """The engine's autocast dtype for ``--precision``: None, or bfloat16 for bf16-mixed (``backends.learner_autocast``).

    Raises:
        UserError: an unknown precision, or bf16-mixed on an engine that is not the learner's transformers one.
    """
    from ..rollout.spec import shares_module
    from .backends import precision_autocast

    if precision not in ("float32", "bf16-mixed"):
        raise UserError(f"--precision {precision!r} must be float32 or bf16-mixed")
    if precision != "float32" and not shares_module(spec):
        raise UserError(f"--precision bf16-mixed is the transformers engine's autocast (as training's); "
                        f"--engine {spec.name} computes in its own precision: drop --precision")
    return precision_autocast(precision)


def _make_engine(spec, model, policy, dev, ctx, benches, max_new_tokens, autocast=None):
    """The engine ``spec`` names: transformers on ``dev``, or vLLM loading ``model`` with a context that holds the
    longest prompt's completion."""
    from ..policy.hub import model_dir
    from ..rollout.spec import make_engine

    longest = max(len(policy.encode_prompt(e.prompt)) for b in benches for e in b.examples)
    # vLLM loads a directory: a hub id's snapshot in the hub cache, as load_policy read it
    return make_engine(spec, policy, model_dir=str(model_dir(model, key="--model")), device=dev, autocast=autocast,
                       max_model_len=max(ctx or 0, longest + max_new_tokens))


def save_results(res: dict, dest: str | Path) -> Path:
    """Write ``evaluate``'s results to ``dest`` as indented JSON (atomically; NaN as null); return the path.

    Raises:
        UserError: the disk refused the write (full, read-only, no permission): one line naming ``--out``.
    """
    from ..records import atomic_write
    from .outputs import refused_output

    dest = Path(dest)
    with refused_output(dest):
        atomic_write(dest, json.dumps(_finite_or_null(res), indent=2))
    return dest


def _finite_or_null(x):
    """NaN (a standard error from one prompt) is not JSON; write null."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_or_null(v) for v in x]
    return x
