"""``trustbatch export RUN_DIR [--step N] --out DIR``: a run's checkpoint as a clean Hugging Face model directory.

``DIR`` gets the policy's weights (``model.safetensors``; a LoRA run's adapter merged into its base, ``W + (α/r)·B·A``,
by ``policy.lora.load_merged``), its tokenizer (chat template included), a ``generation_config.json`` with the
sampling the policy was trained under, and ``README.md``: a model card with the run's resolved config, the commit
that trained it (``segments.jsonl``) and the held-out numbers of the exported round (``metrics.jsonl``). It loads
with ``AutoModelForCausalLM.from_pretrained(DIR)`` and no trustbatch or peft.

For a run on data files the card also gives the ``trustbatch eval`` command that samples the run's held-out
evaluation again: the same prompts, samples per prompt, temperature, completion budget and the evaluation's seed
for that round. The engine draws each prompt's random stream from that seed in prompt order and each completion
depends only on its stream, prompt and weights (``rollout.transformers_engine``), so its pass@1 is the run's
``heldout_accuracy`` for 0/1 rewards, up to float round-off between batch shapes.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from ..config import Config, load_config, read_yaml_file, yaml_dumps
from ..data.benchmarks import file_format
from ..errors import UserError
from ..records import git_commit, package_version, read_metrics
from ..rewards.scorers import MODEL_PREFIX
from ..seeding import row_seed
from ..trainer.checkpoint import BEST, checkpoints, step_of
from .hooks import EVAL_STREAM
from .outputs import output_folder, staged_folder
from .rundir import as_read_now, start_directory

HELDOUT_KEYS = ("heldout_accuracy", "heldout_accuracy_se", "heldout_greedy_accuracy")


def export_run(run_dir: str | Path, out: str | Path, step: int | str | None = None) -> dict:
    """Write checkpoint ``step`` (default: the newest; ``"best"``: the one ``checkpoints/best`` names, kept by
    ``checkpoint_keep_best``) of ``run_dir`` to ``out`` as a Hugging Face model directory.

    ``out`` is written through a temporary sibling and a rename, so it is whole or absent.

    Returns:
        ``{"out", "step", "lora", "heldout" (the exported round's held-out metrics, or {}), "eval_command"
        (a ``trustbatch eval`` command list that runs from any directory, its paths absolute; None for a
        reasoning-gym task)}``. The card's command keeps the config's paths, less their local folders.

    Raises:
        UserError: ``run_dir`` is missing or no run directory, holds no checkpoint, or none at ``step`` (the
            message lists those it has), or no ``best`` link for ``"best"``; ``out`` is a non-empty directory or a file, lies inside a file, or
            cannot be created or written (``outputs.output_folder``); the checkpoint does not load (a LoRA
            checkpoint's base moved, corrupt weights).
    """
    from ..policy import load_policy

    run, cfg, ckpt = _checked_run(Path(run_dir), step)
    step = step_of(ckpt)
    dest = Path(out).expanduser()
    if dest.is_dir() and any(dest.iterdir()):
        raise UserError(f"--out {str(dest)!r} exists and is not an empty directory; give a new directory")
    output_folder(dest, create=False)  # a file, inside a file, unwritable: said before the model loads
    policy = load_policy(ckpt)  # a LoRA checkpoint: its base with the adapter merged, plain layers
    with staged_folder(dest) as tmp:
        policy.save(tmp)
        _generation_config(policy, cfg).save_pretrained(tmp)
        heldout = _heldout_at(run, step)
        command = eval_command(cfg, dest, step)
        # printed in the terminal, to run from anywhere; a run from before segments.jsonl recorded its start
        # directory: its paths as they name files from here, as the command printed before did
        printed = eval_command(cfg, dest.absolute(), step, start=start_directory(run) or os.getcwd())
        policy.set_prompt_format(cfg.data.chat_template, cfg.data.system_prompt)  # as the run framed its prompts
        card = model_card(cfg, run, ckpt, step, heldout, command, chat=bool(policy.chat_template),
                          text_as_is=policy.text_as_is)
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return {"out": str(dest), "step": step, "lora": cfg.model.lora is not None, "heldout": heldout,
            "eval_command": printed}


def _checked_run(run: Path, step: int | str | None) -> tuple[Path, Config, Path]:
    """The run directory, its saved config (keys added since default) and the checkpoint to export."""
    if not run.is_dir() or not (run / "config.yaml").is_file():
        raise UserError(f"{str(run)!r} is not a trustbatch run directory (no config.yaml); give the run_dir of a "
                        "trustbatch train run")
    try:
        saved = read_yaml_file(run / "config.yaml", what="the run's config")
        cfg = load_config(None, None, base=as_read_now(saved) if isinstance(saved, dict) else {})
    except UserError as e:
        raise UserError(f"cannot export {str(run)!r}: {e}") from None
    found = checkpoints(run)
    if not found:
        raise UserError(f"run {str(run)!r} has no checkpoint (checkpoints/step_*); a run writes its first after the "
                        "base evaluation: train it (again), or resume it")
    if step is None:
        return run, cfg, found[-1]
    by_step = {step_of(p): p for p in found}
    if step == BEST:
        link = run / "checkpoints" / BEST
        target = link.resolve() if link.is_symlink() else None
        if target is None or target.parent != (run / "checkpoints").resolve() or target.name not in \
                {p.name for p in found}:
            raise UserError(f"run {str(run)!r} names no best checkpoint (checkpoints/{BEST}); a run keeps one with "
                            f"checkpoint_keep_best=true (a resume may set it): pick a --step of "
                            f"{', '.join(map(str, by_step))}")
        return run, cfg, by_step[step_of(target)]
    if step not in by_step:
        raise UserError(f"run {str(run)!r} has no checkpoint at step {step}; it keeps {', '.join(map(str, by_step))} "
                        "(the newest ones, every checkpoint_every rounds): pick one of them")
    return run, cfg, by_step[step]


def _generation_config(policy, cfg: Config):
    """A generation config of the model's special ids and the sampling the policy was trained under, alone.

    Built fresh, not from the base's: the rollout engine samples softmax(logits / T) with top-p and nothing else
    (``_only_our_sampling`` blanks the base's top-k, repetition penalty, min-p ...), and ``generate`` applies
    top-k 50 where a config names none, so ``top_k`` is written as 0 (off)."""
    from transformers import GenerationConfig

    base = policy.model.generation_config or GenerationConfig.from_model_config(policy.model.config)
    ro = cfg.rollout
    ends = policy.end_ids  # every end token the model has (an Instruct model's end of turn too), not only the EOS
    return GenerationConfig(bos_token_id=base.bos_token_id, eos_token_id=list(ends) if len(ends) > 1 else ends[0],
                            pad_token_id=policy.pad_id, do_sample=True, temperature=ro.temperature, top_p=ro.top_p,
                            top_k=0, max_new_tokens=ro.max_new_tokens)


def _heldout_at(run: Path, step: int) -> dict:
    """The held-out metrics logged at round ``step`` (``{}`` when that round had no evaluation)."""
    recs = [r for r in read_metrics(run / "metrics.jsonl") if r.get("step") == step and "heldout_accuracy" in r] \
        if (run / "metrics.jsonl").is_file() else []
    return {k: v for k, v in recs[-1].items() if k.startswith("heldout_")} if recs else {}


def eval_command(cfg: Config, model: Path, step: int, start: str | None = None) -> list[str] | None:
    """The ``trustbatch eval`` arguments that sample round ``step``'s held-out evaluation of a data-file run again
    (the prompts: ``data.heldout``, else the first ``heldout_size`` distinct ``data.train`` rows); None for a
    reasoning-gym task, whose prompts are no file, and where held-out evaluation was scored by reward functions
    (``eval.reward=functions``, data without answers), which ``trustbatch eval`` does not take.

    ``start``: the directory the run started in (``rundir.start_directory``). Given, a relative data path
    (``data.heldout``/``data.train``, ``data.dir``) that exists from there is made absolute, so the command runs from
    any directory; None keeps the paths as the config has them (the model card's command)."""
    d, n = cfg.data, cfg.eval.samples_per_prompt
    if not d.train:
        return None
    if cfg.reward.name is None and (cfg.eval.reward == "functions" or file_format(
            _from_start(start, d.heldout or d.train), _from_start(start, d.dir), d.format, d.prompt_field,
            d.answer_field) == "prompts"):
        return None  # held-out evaluation scored the reward functions, which eval does not take
    cmd = ["trustbatch", "eval", "--model", str(model), "-b", _from_start(start, d.heldout or d.train),
           "--limit", str(d.heldout_size),
           "-n", str(n), "-k", "1" if n == 1 else f"1,{n}", "--temperature", f"{cfg.eval.temperature:g}",
           "--max-new-tokens", str(cfg.rollout.max_new_tokens),
           "--seed", str(row_seed(cfg.train.seed, step, EVAL_STREAM))]
    for flag, value in (("--data-dir", _from_start(start, d.dir)), ("--reward", cfg.reward.name),
                        ("--prompt-field", d.prompt_field), ("--answer-field", d.answer_field),
                        ("--system-prompt", d.system_prompt)):
        if value is not None:
            cmd += [flag, value]
    if d.format != "auto":
        cmd += ["--format", d.format]
    if not d.prompt_column:
        cmd += ["--no-prompt-column"]
    if d.chat_template != "auto":
        cmd += ["--chat-template", d.chat_template]
    if d.max_prompt_tokens is not None:  # the held-out prompts training kept, as it kept them
        cmd += ["--max-prompt-tokens", str(d.max_prompt_tokens), "--long-prompts", d.long_prompts]
    # held-out evaluation samples with the rollouts' loop and random streams (build._float32_spec)
    ro, defaults = cfg.rollout, type(cfg.rollout).model_fields
    for flag, key in (("--decode", "decode"), ("--noise", "noise")):
        if getattr(ro, key) != defaults[key].default:
            cmd += [flag, getattr(ro, key)]
    if cfg.train.precision == "bf16-mixed":  # it samples under the learner's autocast (build: learner_autocast)
        cmd += ["--precision", "bf16-mixed"]
    # scored as the run scored: its time limit, or none in the trainer's process (workers 0)
    cmd += ["--timeout", f"{cfg.reward.timeout_s:g}"] + (["--workers", "0"] if cfg.reward.workers == 0 else [])
    return cmd


def _from_start(start: str | None, path: str | None) -> str | None:
    """``path`` as named from ``start``, absolute, where it is relative and exists there; else as given (a benchmark
    name such as ``gsm8k`` resolves under ``data.dir`` instead, as ``benchmarks.resolve`` does)."""
    if start is None or path is None or os.path.isabs(os.path.expanduser(path)):
        return path
    there = os.path.join(start, path)
    return os.path.abspath(there) if os.path.exists(there) else path


def model_card(cfg: Config, run: Path, ckpt: Path, step: int, heldout: dict, command: list[str] | None,
               chat: bool = False, text_as_is: bool = False) -> str:
    """README.md of an export: what was trained from what, the numbers, how to check them, the resolved config.
    ``chat``: the prompts went through the tokenizer's chat template; ``text_as_is``: text prompts did not
    (``data.chat_template=messages``).

    The card is published with the folder, so it holds no absolute local path (``_no_local_paths``: each is given by
    its last component), and names the code by commit, else by package version (an installed copy has no git)."""
    trained = _segment_versions(run)
    source = _no_local_paths(cfg.data.train) or f"reasoning-gym task {cfg.task.name} (seed {cfg.task.seed})"
    lora = cfg.model.lora
    lines = ["---", "library_name: transformers", "tags: [trustbatch, reinforcement-learning]", "---", "",
             f"# {run.name}, round {step}", "",
             f"RL post-training with trustbatch: objective `{cfg.objective.name}` on {source}, from "
             f"`{_no_local_paths(cfg.model.path) or 'the default small base'}`"
             + (f", LoRA r={lora.r} alpha={lora.alpha:g} merged into the base weights" if lora else "") + ".",
             f"Exported from `{run.name}/{ckpt.relative_to(run).as_posix() if ckpt.is_relative_to(run) else ckpt.name}`"
             f" with trustbatch {_code_version(git_commit(), package_version())}; trained with trustbatch "
             + (", ".join(trained) if trained else "of unknown version (not recorded by this run)") + ".",
             "Local paths are given by their last component.", ""]
    if chat:
        lines += [("Prompts given as chat messages were sent through the tokenizer's chat template as those "
                   "messages, and text prompts as they are (TRL's rule)" if text_as_is else
                   "Prompts were sent through the tokenizer's chat template, a text prompt as a user message and a "
                   "prompt given as chat messages as those messages")
                  + (f", after the system message {cfg.data.system_prompt!r} (unless the messages held one)"
                     if cfg.data.system_prompt else "") + ".", ""]
    lines += ["## Held-out evaluation", ""]
    if heldout:
        lines += ["| metric | value |", "| --- | --- |"] + [f"| {k} | {v:.4f} |" for k, v in heldout.items()
                                                             if isinstance(v, (int, float))]
        lines += ["", f"At round {step}: {cfg.eval.samples_per_prompt} samples per held-out prompt at temperature "
                  f"{cfg.eval.temperature:g}, {cfg.rollout.max_new_tokens} new tokens at most. heldout_accuracy is "
                  "the mean reward (pass@1 for 0/1 rewards)."]
    else:
        lines += [f"Round {step} had no held-out evaluation (eval.every={cfg.eval.every})."]
    if command:
        lines += ["", "The same evaluation, sampled again from this directory (the same prompts and random streams), "
                  "run beside it and the data files:", "", "```", shlex.join(_no_local_paths(command)), "```"]
    config = yaml_dumps(_no_local_paths(cfg.model_dump(mode="json")), sort_keys=False)
    lines += ["", "## Training configuration", "", "```yaml", config.rstrip(), "```", ""]
    return "\n".join(lines)


def _no_local_paths(value):
    """``value`` (a string, or lists and dicts of them) with each absolute or home-relative path replaced by its
    last component, so that a published card does not reveal the machine's folders."""
    if isinstance(value, dict):
        return {k: _no_local_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_local_paths(v) for v in value]
    if isinstance(value, str) and value.startswith(MODEL_PREFIX):  # a reward model term of reward.functions
        return MODEL_PREFIX + _no_local_paths(value.removeprefix(MODEL_PREFIX))
    if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")):
        return Path(value).name or value
    return value


def _code_version(commit: str | None, version: str | None) -> str:
    """``commit abc1234``, else ``version 0.1.0`` (an installed copy, no git), else ``of unknown version``."""
    if commit and commit != "unknown":
        return f"commit `{commit}`"
    if version and version != "unknown":
        return f"version `{version}`"
    return "of unknown version"


def _segment_versions(run: Path) -> list[str]:
    """The distinct code versions (``_code_version``) of the run's segments (start and resumes), in order; older
    runs recorded none."""
    seg = run / "segments.jsonl"
    out: list[str] = []
    for line in seg.read_text().splitlines() if seg.is_file() else []:
        try:
            rec = json.loads(line)
            v = _code_version(rec.get("commit"), rec.get("version"))
        except (json.JSONDecodeError, AttributeError):
            continue
        if v not in out:
            out.append(v)
    return out
