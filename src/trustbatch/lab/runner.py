"""Run an experiment's arms × seeds as ``trustbatch train`` processes, several at a time, resumable.

Each run is a process forked from a server that has already imported torch and the rest (``lab.launch``).

Layout: ``OUT/<experiment>/<arm>/seed<k>/`` is an ordinary run directory. A run with a
``summary.json`` is done and skipped; one with a checkpoint resumes from it; others start over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import dump_config, load_config
from ..recipes.defaults import with_answer_budget
from ..errors import UserError
from ..interrupts import raise_interrupt
from ..processes import die_with_parent
from ..records import atomic_write
from .calls import record_call
from .experiment import Experiment
from .launch import Run


def _command(exp: Experiment, arm: str, seed: int, run_dir: Path) -> list[str] | None:
    """The ``trustbatch`` arguments that train or resume this run; None when it is done."""
    if (run_dir / "summary.json").exists():
        return None
    base = ["train"]
    if any((run_dir / "checkpoints").glob("step_*")):
        return base + ["--resume", str(run_dir)]
    if run_dir.exists():
        shutil.rmtree(run_dir)  # started but never checkpointed: start over
    run_dir.mkdir(parents=True)
    # the defaults that follow the data first: the written file sets every key, rollout.max_new_tokens included
    cfg = with_answer_budget(load_config(None, exp.overrides(arm, seed) + [f"run_dir={run_dir}"]))[0]
    atomic_write(run_dir.parent / f"seed{seed}.yaml", dump_config(cfg))
    return base + ["--config", str(run_dir.parent / f"seed{seed}.yaml")]


def _build_base(overrides: list[str], foreign: bool, threads: int | None = None) -> None:
    """Build (or load from the cache) one run's base, and with ``foreign`` its foreign base too.

    ``threads`` sets torch's intra-op threads first (a worker process of ``build_shared_base``)."""
    from ..recipes.build import foreign_engine, prepare_run

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    cfg = load_config(None, overrides)
    task, policy, pool, _ = prepare_run(cfg)
    pool.close()
    if foreign:
        foreign_engine(cfg, task, policy)


def base_builds(exp: Experiment) -> list[list[tuple[str, int, list[str], bool]]]:
    """The distinct builds ``exp``'s runs need, in two waves: [(arm, seed, overrides, foreign?), ...] per wave.

    Wave 1 builds each distinct base (task and model settings) once; wave 2 each distinct foreign base once,
    after the bases it loads are cached. Keying by what is built, not by arm, keeps two workers from
    training the same model at once (an on-policy arm and a foreign arm share their seed's base).
    """
    from ..policy.base import base_key
    from ..recipes.build import task_key

    bases: dict[tuple, tuple] = {}
    foreigns: dict[tuple, tuple] = {}
    for arm, seed in exp.runs:
        overrides = exp.overrides(arm, seed)
        cfg = load_config(None, overrides)
        model = cfg.model.model_dump(mode="json")
        # the base cache's own key: arms that differ in settings no base reads (model.lora, a reference) share one
        # base, and two workers built it at once
        if cfg.model.path is None:
            bases.setdefault(base_key(task_key(cfg), model), (arm, seed, overrides, False))
        if cfg.rollout.foreign_fraction > 0:
            spec = cfg.rollout.foreign_model
            # a mapping is merged into the model settings (recipes.build.foreign_engine); a name is itself the key
            what = base_key(task_key(cfg), {**model, **spec}) if isinstance(spec, dict) else json.dumps(spec, default=str)
            foreigns.setdefault((cfg.model.path, what), (arm, seed, overrides, True))
    return [w for w in (list(bases.values()), list(foreigns.values())) if w]


def build_shared_base(exp: Experiment, console, jobs: int = 1) -> None:
    """Build (or find cached) each base and foreign base the runs need, once, before the runs would each build them.

    With ``jobs`` > 1 the builds of a wave (``base_builds``) run ``jobs`` at a time, each in a spawned process of
    one thread, as the runs themselves do: an SFT of these small models gains little from a second thread, so
    two one-thread builds use two cores better than one two-thread build. A spawned worker imports the caller's
    main module again: a script calling ``run_experiment`` needs the ``if __name__ == "__main__":`` guard
    (``trustbatch lab run`` and ``python -m trustbatch`` have it).

    Raises:
        UserError: a build failed (which seed and arm, and why); the builds not yet started are cancelled.
    """
    waves = base_builds(exp)
    if jobs <= 1 or sum(len(w) for w in waves) <= 1:
        for wave in waves:
            for arm, seed, overrides, foreign in wave:
                console.print(f"[dim]seed {seed}, {arm}: building or loading the cached {'foreign ' * foreign}base model…[/dim]")
                _build_base(overrides, foreign)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a fork of a process that already ran torch can deadlock in its thread pools; a builder dies with the runner
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as ex:
        for wave in waves:
            console.print(f"[dim]building or loading {len(wave)} cached {'foreign ' * wave[0][3]}base models, "
                          f"{jobs} at a time…[/dim]")
            futures = [(ex.submit(_build_base, overrides, foreign, 1), arm, seed) for arm, seed, overrides, foreign in wave]
            for f, arm, seed in futures:
                try:
                    f.result()
                except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the builds now, not after every queued one
                    _stop_builds(ex)
                    raise
                except Exception as e:
                    ex.shutdown(cancel_futures=True)
                    raise UserError(f"seed {seed}, {arm}: building the base model failed: "
                                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def _stop_builds(ex) -> None:
    """Cancel the builds not started and end the running ones (their bases are cached only once complete: an
    interrupted build leaves nothing a later call would load)."""
    running = list((getattr(ex, "_processes", None) or {}).values())  # shutdown forgets them
    ex.shutdown(wait=False, cancel_futures=True)
    for proc in running:
        proc.terminate()


def _sigterm_as_interrupt():
    """Make SIGTERM raise KeyboardInterrupt (main thread only), unless one is already unwinding: the CLI's
    ``interrupt_guard`` re-delivers the signal every 2 s, which cut the runs' stop (up to 60 s) short, so runs were
    left going and the call unrecorded. Returns the function that restores the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = signal.signal(signal.SIGTERM, raise_interrupt)
    return lambda: signal.signal(signal.SIGTERM, old)


def _stop(running: list, grace_s: float = 60.0) -> None:
    """SIGTERM every run still going (``trustbatch train`` stops at once; it resumes from its last checkpoint),
    then SIGKILL whatever is left after ``grace_s``."""
    for proc, *_ in running:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + grace_s
    for proc, _arm, _seed in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except TimeoutError:
            proc.kill()
            proc.wait()
    running.clear()


@dataclass
class _Tally:
    """One call's runs so far: updated as runs start and end, so that a Ctrl-C or SIGTERM still stops the ones
    ``running`` and records how many started and which failed."""

    started: int = 0
    failed: list[str] = field(default_factory=list)
    running: list[tuple[Run, str, int]] = field(default_factory=list)


def run_experiment(exp: Experiment, out: Path, *, jobs: int = 2, console=None) -> dict:
    """Run every (arm, seed) not yet done, ``jobs`` at a time. Returns {"done", "failed", "wall_s"} (this call's,
    base builds included).

    Every call appends its seeds, arms, commit, command and interval to ``OUT/EXPERIMENT/calls.jsonl``, and
    ``wall_s.txt`` becomes the wall-clock time the calls cover together (``lab.calls``: overlapping calls count
    once). ``experiment.yaml`` lists the union of the seeds run in the folder; each call's commit is in ``calls.jsonl``.

    Each run's stdout/stderr goes to ``<run_dir>.log``. A failed run is reported, the others go on. Ctrl-C or
    SIGTERM stops the runs still going (the next call resumes them from their checkpoints) and records the call
    as interrupted before KeyboardInterrupt propagates.
    """
    from rich.console import Console

    from .report.provenance import git_commit

    console = console or Console()
    root = out / exp.name
    root.mkdir(parents=True, exist_ok=True)
    t_call = time.time()
    commit, command = git_commit(), f"trustbatch lab run {exp.source or exp.name} --out {out} --jobs {jobs}"
    if exp.selected is not None:
        command += f" --arms {','.join(exp.selected)}"
    _write_spec(exp, root, commit, command)
    todo = exp.runs
    t0 = None
    tally = _Tally()
    interrupted = True
    # SIGTERM (a scheduler, `kill`) is handled as Ctrl-C: the runs are stopped with the runner, never orphaned
    restore = _sigterm_as_interrupt()
    try:
        build_shared_base(exp, console, jobs=jobs)
        t0 = time.time()
        _run_all(exp, root, todo, jobs, console, tally)
        interrupted = False
    except KeyboardInterrupt as e:
        if str(e):
            raise
        # not the recorded command: it omits --seeds, and a resume must name the same seeds
        raise KeyboardInterrupt("interrupted; finished runs are kept, and the same `trustbatch lab run` command "
                                "resumes the others from their last checkpoints") from None
    finally:
        _stop(tally.running)
        restore()
        # recorded even when interrupted (Ctrl-C, a failed build): its time was spent all the same
        end = time.time()
        record_call(root, {"start": t_call, "end": end, "build_s": round((t0 or end) - t_call, 1),
                           "seeds": list(exp.seeds), "tune_seeds": list(exp.tune_seeds),
                           "arms": sorted({a for a, _ in todo}), "runs_started": tally.started, "failed": tally.failed,
                           "interrupted": interrupted, "commit": commit, "command": command})
    wall = end - t_call
    return {"done": len(todo) - len(tally.failed), "failed": tally.failed, "wall_s": wall}


def _write_spec(exp: Experiment, root: Path, commit: str, command: str) -> None:
    """Write ``root/experiment.yaml``: the experiment as this call runs it, its seeds joined with those of the
    earlier calls into this folder."""
    seeds = list(exp.seeds)
    if (root / "experiment.yaml").exists():  # seeds added in a later call join the earlier ones
        try:
            prior = yaml.safe_load((root / "experiment.yaml").read_text()) or {}
        except yaml.YAMLError:
            prior = {}
        seeds = sorted(set(seeds) | {int(x) for x in prior.get("seeds") or []})
    atomic_write(root / "experiment.yaml", yaml.safe_dump(
        {"description": exp.description, "seeds": seeds, "arms": exp.arms, "per_seed_base": exp.per_seed_base,
         "compare": [list(c) for c in exp.compare], "preflight_only": exp.preflight_only,
         **({"tune": {"arms": exp.tune_arms, "seeds": exp.tune_seeds}} if exp.tune_arms else {}), **exp.analysis,
         **({"registered": exp.registered} if exp.registered else {}), "commit": commit,
         "command": command}, sort_keys=False))


def _run_all(exp: Experiment, root: Path, todo: list[tuple[str, int]], jobs: int, console, tally: _Tally) -> None:
    """Train or resume each run of ``todo`` not yet done, ``jobs`` processes at a time, with a progress bar; a
    failed run is printed and added to ``tally.failed``, the others go on."""
    from ..trainer.progress import progress_display

    with progress_display(console, f"lab {exp.name}", lines=len(todo)) as progress:  # a line per run off a terminal
        bar = progress.add_task(f"lab {exp.name}: runs", total=len(todo))
        queue = list(todo)
        while queue or tally.running:
            while queue and len(tally.running) < jobs:
                arm, seed = queue.pop(0)
                run_dir = root / arm / f"seed{seed}"
                cmd = _command(exp, arm, seed, run_dir)
                if cmd is None:
                    progress.advance(bar)
                    continue
                tally.started += 1
                tally.running.append((Run(cmd, run_dir.parent / f"seed{seed}.log"), arm, seed))
            time.sleep(0.5)
            for item in list(tally.running):
                proc, arm, seed = item
                if proc.poll() is None:
                    continue
                tally.running.remove(item)
                progress.advance(bar)
                if proc.returncode != 0:
                    tally.failed.append(f"{arm}/seed{seed}")
                    console.print(f"[red]{arm} seed {seed} failed (exit {proc.returncode}); see {root / arm / f'seed{seed}.log'}[/red]")
