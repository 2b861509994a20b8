"""``trustbatch train``: the run directory, resume, the loop's hooks (log, evaluate, checkpoint) and the summary.

A run directory holds one run (an exclusive lock); a resume continues it bit-identically on CPU
(every random stream and optimizer state is in the checkpoint) and may change only how long it runs
and how often it reports (``rundir.RESUMABLE_KEYS``).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import random
import shutil
import time
from datetime import datetime
from pathlib import Path

import torch

from ..config import Config, dump_config, load_config, read_yaml_file
from ..errors import UserError
from ..interrupts import interrupt_guard
from ..parallel import World
from ..records import atomic_write, read_metrics, truncate_records
from ..rewards.pool import read_in_process_marker
from ..rollout.spec import check_ranks
from ..trainer.checkpoint import checkpoints, clean_temporaries, load_latest
from ..trainer.loop import run_loop
from ..trainer.progress import Progress
from ..trainer.runlog import plot_run
from ..trainer.trackers import check_trackers, require_trackers
from .build import (build_parts, checkpoint_loader, engine_spec, foreign_engine, preflight, prepare_run,
                    reference_policy, restore_checkpoint_policy, scoring_check)
from .defaults import with_answer_budget
from .hooks import TrainHooks
from .rundir import (RunLock, as_read_now, make_new, check_resume_changes, check_resume_paths, open_metrics_log,
                     record_segment, run_dir_write_error, set_aside, set_aside_unloadable)


IN_PROCESS_MARKER = "scoring_in_process.json"  # in the run directory: see _in_process_scoring


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run; the message says how to resume."""


def saved_config(run_dir: Path) -> dict:
    """The config a run directory to resume saved (``config.yaml``), as a dict.

    Raises:
        UserError: no such directory, no ``config.yaml``, or one that is not valid YAML or not a mapping.
    """
    if not run_dir.is_dir():
        what = "it is a file, not a directory" if run_dir.exists() else "no such directory"
        raise UserError(f"cannot resume {str(run_dir)!r}: {what}; give the run_dir of a trustbatch train run")
    if not (run_dir / "config.yaml").exists():
        raise UserError(f"cannot resume {str(run_dir)!r}: it has no config.yaml (not a trustbatch run directory)")
    try:
        saved = read_yaml_file(run_dir / "config.yaml", what="the run's config")
    except UserError as e:
        raise UserError(f"cannot resume {str(run_dir)!r}: {e}; restore it or start a new run") from None
    if not isinstance(saved, dict):
        raise UserError(f"cannot resume {str(run_dir)!r}: its config.yaml is not a mapping; restore it or start a new run")
    return saved


def _resolve_run(cfg: Config | None, resume: str | None, overrides: list[str] | None):
    """(cfg, run_dir, changed keys, lines to print) for a new run or a resume; refuses what would lose or mix records.

    A new run's directory that holds a start interrupted before its first checkpoint (nothing to resume) is set aside
    (``rundir.set_aside``, by rank 0) and started over; one with a checkpoint is refused (``--resume`` it).
    """
    if resume:
        run_dir = Path(resume)
        saved = saved_config(run_dir)
        check_resume_paths(saved, run_dir)
        as_read_now(saved)
        cfg = load_config(None, overrides, base=copy.deepcopy(saved))  # load_config sets keys in nested dicts of base
        if any(o.partition("=")[0].strip() == "run_dir" for o in overrides or []) and \
                Path(cfg.run_dir or "").resolve() != run_dir.resolve():
            raise UserError(f"run_dir={cfg.run_dir} with --resume {run_dir}: a resume continues in the run's own "
                            "directory; copy or move the run directory there and --resume it, or drop run_dir")
        changed = check_resume_changes(saved, cfg.model_copy(update={"run_dir": saved.get("run_dir")}).model_dump(mode="json"),
                                       defaults=load_config().model_dump(mode="json"))
        return cfg, run_dir, changed, []
    if overrides and cfg is not None:
        raise UserError("train(cfg, overrides=...) for a new run: the overrides would be lost; pass "
                        "load_config(None, overrides) as cfg, or the overrides alone")
    cfg, budget = with_answer_budget(cfg or load_config(None, overrides))
    notes = [budget] if budget else []
    run_dir = Path(cfg.run_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}-{cfg.objective.name}")
    # a default name another start took is not this run's (train claims a new one)
    started = cfg.run_dir is not None and ((run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists())
    if started and int(os.environ.get("RANK", "0")) == 0:  # the other ranks never write the directory
        if not (run_dir / ".lock").exists():  # every start takes its lock first: these files are the user's
            raise UserError(f"run_dir {str(run_dir)!r} holds a config.yaml or metrics.jsonl that no trustbatch run "
                            "wrote there (it has no .lock); give a new or empty directory as run_dir (nothing in it "
                            "was moved)")
        with RunLock(run_dir):  # a run still training there is named (its pid), not sent to --resume
            if checkpoints(run_dir):
                raise UserError(f"run directory {str(run_dir)!r} already holds a run; use --resume {run_dir} or "
                                "another run_dir")
            notes.append(f"{run_dir} held a start that ended before its first checkpoint: its files are kept in "
                         f"{set_aside(run_dir)}; starting over")
    return cfg, run_dir, [], notes


def train(cfg: Config | None = None, resume: str | None = None, overrides: list[str] | None = None,
          console=None) -> dict:
    """Run RL post-training. Returns the summary dict (also written to ``summary.json``).

    ``resume`` continues the run in that directory from its newest intact checkpoint; ``overrides``
    then apply on top of its saved config (only ``RESUMABLE_KEYS``, e.g. ``train.steps=300``). A new run takes
    ``cfg`` or ``overrides`` (``key=value`` on the defaults), not both.
    Under ``torchrun --nproc-per-node N`` every rank runs this; rank 0 alone writes the run directory.

    Raises:
        UserError: bad configuration, a locked or finished run directory, an invalid resume, ``cfg`` with
            ``overrides`` for a new run.
        RunInterrupted: Ctrl-C or SIGTERM (the last checkpoint is intact).
    """
    from rich.console import Console

    started = time.time()
    console = console or Console(soft_wrap=True)  # a line to a log file stays one line
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 alone speaks; errors still end every rank
        console = Console(quiet=True)
    cfg, run_dir, changed, notes = _resolve_run(cfg, resume, overrides)
    for line in notes:
        console.print(line, highlight=False, markup=False)
    preflight(cfg)
    require_trackers(cfg.log.trackers)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    world = _world(cfg, run_dir)
    try:
        created = False  # whether this start made the directory: only then may it remove it
        if world.is_main and resume is None:
            run_dir, created = make_new(run_dir, default_name=cfg.run_dir is None)
        with interrupt_guard(), RunLock(run_dir) if world.is_main else contextlib.nullcontext():
            try:
                return _train_locked(cfg, run_dir, changed, resume is not None, world, console, started)
            except UserError:
                # refused for its input (a data file, the model, the task) before any checkpoint: the directory
                # this start made holds nothing to keep, and a next start would take it for an interrupted one.
                # Under the lock: a start the lock refused never reaches here (it removed the live run's files)
                if created and not checkpoints(run_dir):
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
    except KeyboardInterrupt:
        if not checkpoints(run_dir):
            raise RunInterrupted("interrupted before the first checkpoint; nothing to resume; run again with the same "
                                 "command to start over") from None
        raise RunInterrupted(f"interrupted; the last checkpoint is intact: resume with "
                             f"`trustbatch train --resume {run_dir}`") from None
    except OSError as e:  # the run directory cannot be written: one line, not a traceback
        if not run_dir_write_error(e, run_dir):
            raise
        if run_dir.is_file():
            raise UserError(f"run_dir {str(run_dir)!r} is a file; give a directory") from None
        limited = e.errno == errno.EFBIG  # a file-size limit: its strerror names it (records.write_failure)
        reason = (e.strerror if limited else None) or os.strerror(e.errno)
        fix = "raise the file-size limit" if limited else "free disk space, fix the permissions or give another run_dir"
        raise UserError(f"cannot write {e.filename or run_dir} ({reason}); {fix} (a run with a checkpoint continues "
                        f"with --resume {run_dir})") from None
    finally:
        world.close()


def _world(cfg: Config, run_dir: Path) -> World:
    """This process's ``World`` (torchrun's ranks, or one), once the trackers it opens answer.

    Raises:
        UserError: a device that is not there, a tracker store that does not answer, fewer prompts than ranks, an
            engine that does not run under several ranks.
    """
    try:
        world = World.from_env(cfg.train.device)
    except ValueError as e:
        raise UserError(str(e)) from None
    if world.is_main:  # the rank that opens them; a store is created once, not by every rank at once
        check_trackers(cfg.log.trackers, cfg.log.mlflow_uri, run_dir)
    check_ranks(engine_spec(cfg), world.size)
    if world.size > 1 and cfg.rollout.prompts_per_step < world.size:
        raise UserError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is below the {world.size} ranks; "
                        "give every rank at least one prompt")
    return world


def train_command(config: str | None = None, overrides: list[str] | None = None, resume: str | None = None) -> dict:
    """``trustbatch train``'s arguments to a run: the CLI's command and a lab run's process both call this.

    ``config`` (a YAML file) and ``overrides`` (``key=value``) make a new run's config; ``resume`` (a run
    directory) continues that run, with ``overrides`` of its ``RESUMABLE_KEYS`` only. Returns ``train``'s summary.

    Raises:
        UserError: ``resume`` given with ``config``; anything ``load_config`` or ``train`` raises as one.
        RunInterrupted: Ctrl-C or SIGTERM (the last checkpoint is intact).
    """
    _refuse_config_with_resume(config, resume)
    cfg = None if resume else load_config(config, overrides)
    return train(cfg, resume=resume, overrides=overrides if resume else None)


def resolved_config(config: str | None = None, overrides: list[str] | None = None, resume: str | None = None) -> Config:
    """The configuration ``train_command`` would run with (``trustbatch train --print-config``), resolved without
    creating, locking or writing a run directory: a resume's saved config with its overrides, else defaults ← file ←
    overrides.

    Raises:
        UserError: as ``train_command`` for the same arguments, before any run starts (a resume's non-resumable
            override, an unknown key, an invalid value, ...).
    """
    _refuse_config_with_resume(config, resume)
    if resume:
        return _resolve_run(None, resume, overrides)[0]
    return with_answer_budget(load_config(config, overrides))[0]


def _refuse_config_with_resume(config: str | None, resume: str | None) -> None:
    if resume and config:
        raise UserError("--resume uses the run's saved config; give overrides as key=value instead of --config")


def _check_resumable(cfg: Config, run_dir: Path, found) -> None:
    """Refuse a resume that would train nothing or redo what the run's records hold: a finished run that
    ``train.steps`` does not extend, ``train.steps`` below the checkpoint's round (or at it, when that round was not
    evaluated: the run would end without a final evaluation, its summary naming an older accuracy), or trained rounds
    on record but no checkpoint to continue them from (a start from round 0 would overwrite them). A run stopped
    before its first round resumes from round 0. A ``summary.json`` counts only when it is the checkpoint round's
    (one left by an earlier segment of a resume that was killed says nothing of the rounds after it)."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    if found is None:
        trained = max((int(r.get("step", 0)) for r in records), default=0)
        if trained > 0 or (run_dir / "summary.json").exists():
            raise UserError(f"run {str(run_dir)!r} has no checkpoint to resume from, but its records hold "
                            f"{trained} trained rounds; restore its checkpoints/ folder, or start a new run in "
                            "another run_dir")
        return
    done = int(found[2]["step"])
    if _summary_steps(run_dir) == done and cfg.train.steps <= done:
        raise UserError(f"run {str(run_dir)!r} already finished at round {done}; "
                        f"raise train.steps (e.g. train.steps={done * 2}) to continue it")
    evaluated = any(int(r.get("step", -1)) == done and "heldout_accuracy" in r for r in records)
    least = done if evaluated else done + 1
    if cfg.train.steps < least:
        why = "" if evaluated else ", and that round was not evaluated"
        raise UserError(f"run {str(run_dir)!r} has trained {done} rounds (its last checkpoint{why}); train.steps="
                        f"{cfg.train.steps} is too few: set train.steps={least} or more to continue it")


def _summary_steps(run_dir: Path) -> int | None:
    """The round the run's ``summary.json`` was written at, or None (no summary, or one that cannot be read)."""
    try:
        steps = json.loads((run_dir / "summary.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return int(steps) if isinstance(steps, (int, float)) else None


def _train_locked(cfg: Config, run_dir: Path, changed: list[str], resuming: bool, world: World, console,
                  started: float) -> dict:
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        clean_temporaries(run_dir)
    found = load_latest(run_dir, checkpoint_loader(cfg)) if resuming else None
    if found is not None and world.is_main:
        for ckpt, kept in set_aside_unloadable(run_dir, found[0]):
            console.print(f"[yellow]warning: {ckpt.parent.name}/{ckpt.name} did not load: kept as {kept.name}, out of "
                          "the rotation[/yellow]", highlight=False)
    if resuming:
        _check_resumable(cfg, run_dir, found)
    if world.is_main:
        atomic_write(run_dir / "config.yaml", dump_config(cfg.model_copy(update={"run_dir": str(run_dir)})))
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed + world.rank)  # ranks sample different completions

    # ---- task, policy, reward pool, parts -----------------------------------------------------
    if not world.is_main:
        world.barrier()  # rank 0 builds (or finds) the cached default base first, the others then load it
    task, policy, pool, source = prepare_run(cfg, console)
    if world.is_main:
        world.barrier()
        _in_process_scoring(cfg, run_dir, pool, console)
    built = log = None
    try:
        # the checkpoint resumed from (-1: none) is known before anything runs: the trackers agree with the record first
        resume_round = (int(found[2]["step"]) if found is not None else -1) if resuming else None
        log = open_metrics_log(cfg, run_dir, resume_round, enabled=world.is_main)
        policy.model.to(world.device)
        foreign = foreign_engine(cfg, task, policy) if cfg.rollout.foreign_fraction > 0 else None  # the base, not a checkpoint
        reference = reference_policy(cfg, policy)  # likewise the initial policy, before a checkpoint's weights
        start, state = 0, None
        if found is not None:
            ckpt, loaded, state = found
            policy = restore_checkpoint_policy(cfg, policy, ckpt, loaded)
            policy.model.to(world.device)
            start = int(state["step"])
        version = state["learner"]["policy_version"] if state else 0
        built = build_parts(cfg, task, policy, pool, foreign=foreign, world=world, version=version,
                            check_round=scoring_check(cfg, task, console), reference=reference)
        parts = built.parts
        progress = Progress(console, total=cfg.train.steps, start=start, enabled=world.is_main)
        hooks = TrainHooks(cfg, run_dir, built, policy, task, pool, log, progress, world, console,
                           wall_before=float(state.get("wall_s", 0.0)) if state else 0.0, started=started)
        if state is not None:
            _restore_state(parts, state, policy.model, version, world)
            console.print(f"resuming {run_dir} from {ckpt.name}")
        if resuming and world.is_main:  # records past the checkpoint (or all of them, without one) are redone
            for name in ("ratios.jsonl", "steps.jsonl"):  # metrics.jsonl and samples.jsonl: open_metrics_log
                truncate_records(run_dir / name, start if state is not None else -1)
            # the last segment's summary ends here: until this segment writes its own, the run is unfinished
            (run_dir / "summary.json").unlink(missing_ok=True)
        if world.is_main:
            record_segment(run_dir, start, cfg.train.steps, changed)
        _print_header(cfg, task, source, run_dir, world, console)
        if state is None:  # not when resuming from the step-0 checkpoint
            if world.is_main:
                base_eval = hooks.evaluate(0)
                log.log(0, base_eval)
                console.print(f"base policy: held-out accuracy {base_eval['heldout_accuracy']:.3f} "
                              f"(greedy {base_eval['heldout_greedy_accuracy']:.3f})")
            hooks.save(0)  # a crash before the first checkpoint_every still leaves a run that resumes

        # ---- the loop -----------------------------------------------------------------------------
        with progress:
            last = run_loop(parts, hooks, start_round=start, rounds=cfg.train.steps)
    except BaseException:
        if log is not None:
            log.close(failed=True)
        raise
    finally:
        if built is not None:
            built.parts.source.close()
        pool.close()
    if not world.is_main:
        return {}
    summary = _summary(cfg, task, run_dir, last, hooks.wall_s(), learner_ranks(cfg, world), console)
    log.close(artifacts=(run_dir / "plot.png",))
    return summary


def _print_header(cfg: Config, task, source: str, run_dir: Path, world: World, console) -> None:
    """The run's header: objective, task and model; where it runs (``where_it_runs``); bf16 on a CPU; the run dir."""
    console.print(f"[bold]trustbatch train[/bold] objective={cfg.objective.name} task={task.name} "
                  f"({len(task.train)} train / {len(task.heldout)} held-out prompts) model={source}")
    console.print(where_it_runs(cfg, world), highlight=False, markup=False)
    if cfg.train.precision == "bf16-mixed" and world.device.type == "cpu":
        console.print(f"[yellow]{BF16_ON_CPU}[/yellow]", highlight=False, soft_wrap=True)
    console.print(f"run directory: {run_dir}")


def _restore_state(parts, state: dict, model, version: int, world: World) -> None:
    """The checkpoint's learner, source and weight-sync state and this rank's torch and Python random streams (and
    its CUDA generator's, ``World.random_states``).

    At the world size the checkpoint was written at, each rank takes its own streams (``rank_rng``); at another
    (or from a checkpoint without them) every rank takes rank 0's, and the run goes on, though not as it would have.
    """
    parts.learner.load_state_dict(state["learner"])
    parts.source.load_state_dict(state["source"])
    if "sync" in state:
        parts.sync.load_state_dict(state["sync"])
        parts.sync.push(model, version)  # serve the restored (lagged) weights
    rank_rng = state.get("rank_rng") or []
    world.set_random_states(rank_rng[world.rank] if len(rank_rng) == world.size
                            else (state["torch_rng"], state["python_rng"]))


def _in_process_scoring(cfg: Config, run_dir: Path, pool, console) -> None:
    """Report a last start that died inside an in-process scorer; with reward.workers=0, say what it risks and
    mark each scoring call (``RewardPool.in_process_marker``). One line each, unwrapped."""
    marker = run_dir / IN_PROCESS_MARKER
    died = read_in_process_marker(marker)
    if died:
        console.print(f"[yellow]{died}[/yellow]", highlight=False, soft_wrap=True)
    if cfg.reward.workers == 0:
        console.print("[yellow]warning: reward.workers=0 scores in the trainer's process with no time limit: a scorer "
                      "that exits or hangs takes the run with it (reward.workers>=1 times out and counts such "
                      "failures)[/yellow]", highlight=False, soft_wrap=True)
        pool.in_process_marker = marker


def _summary(cfg: Config, task, run_dir: Path, last: dict, wall_s: float, world_size: int, console) -> dict:
    """Write ``summary.json`` and print the closing line. ``wall_s``: seconds of all the run's segments (each resume
    adds its own to the time up to the checkpoint it resumed from, ``TrainHooks.wall_s``)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_run(records, run_dir / "plot.png", title=f"{cfg.objective.name} on {task.name}",
             eval_temperature=cfg.eval.temperature)
    evals = [r for r in records if "heldout_accuracy" in r]
    trained = [r for r in records if r.get("step", 0) > 0 and "skipped_step" not in r]
    last = last or (trained[-1] if trained else {})
    summary = {
        "objective": cfg.objective.name,
        "task": task.name,
        "steps": cfg.train.steps,
        "heldout_prompts": len(task.heldout),
        "base_heldout_accuracy": evals[0]["heldout_accuracy"] if evals else None,
        "final_heldout_accuracy": evals[-1]["heldout_accuracy"] if evals else None,
        "base_heldout_greedy_accuracy": evals[0].get("heldout_greedy_accuracy") if evals else None,
        "final_heldout_greedy_accuracy": evals[-1].get("heldout_greedy_accuracy") if evals else None,
        "final_reward_mean": last.get("reward_mean"),
        "final_ess": last.get("ess"),
        "wall_s": wall_s,
        "world_size": world_size,
        "run_dir": str(run_dir),
    }
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2))
    console.print(
        f"[bold]done[/bold] in {summary['wall_s']:.0f}s: held-out accuracy "
        f"{_fmt(summary['base_heldout_accuracy'])} → {_fmt(summary['final_heldout_accuracy'])} "
        f"(greedy {_fmt(summary['base_heldout_greedy_accuracy'])} → {_fmt(summary['final_heldout_greedy_accuracy'])}); "
        f"plot {run_dir / 'plot.png'}"
    )
    return summary


BF16_ON_CPU = ("warning: train.precision=bf16-mixed on the CPU is slower than float32 there (CPU bfloat16 autocast "
               "has few fast kernels: 1.3-1.6x a learner step with one thread, up to 14x a round with both cores of a "
               "2-core x86 host) and saves only memory; use train.precision=float32 on a CPU")


def learner_ranks(cfg: Config, world: World) -> int:
    """The data-parallel learner ranks: torchrun's world size, or the Ray learner actors (``backends.ray_learner``:
    ``ray_learners`` under ``orchestrator=ray`` in one process)."""
    return cfg.ray_learners if cfg.orchestrator == "ray" and cfg.ray_learners > 0 and world.size == 1 else world.size


def where_it_runs(cfg: Config, world: World) -> str:
    """The header line that says where the run trains: device (with the GPU's name), precision, strategy and world
    size, e.g. ``device cuda:0 (NVIDIA H100 80GB HBM3), precision bf16-mixed, strategy fsdp2, world size 4``."""
    dev = world.device
    name = f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""
    ray = " (Ray learner actors)" if learner_ranks(cfg, world) != world.size else ""
    return (f"device {dev}{name}, precision {cfg.train.precision}, strategy {cfg.train.strategy}, "
            f"world size {learner_ranks(cfg, world)}{ray}")


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
