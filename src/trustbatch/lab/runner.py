"""Run an experiment's arms × seeds as ``trustbatch train`` processes, several at a time, resumable.

Layout: ``OUT/<experiment>/<arm>/seed<k>/`` is an ordinary run directory. A run with a
``summary.json`` is done and skipped; one with a checkpoint resumes from it; others start over.
"""

from __future__ import annotations

import json

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ..config import dump_config, load_config
from .experiment import Experiment


def _command(exp: Experiment, arm: str, seed: int, run_dir: Path) -> list[str] | None:
    if (run_dir / "summary.json").exists():
        return None
    base = [sys.executable, "-m", "trustbatch", "train"]
    if any((run_dir / "checkpoints").glob("step_*")):
        return base + ["--resume", str(run_dir)]
    if run_dir.exists():
        shutil.rmtree(run_dir)  # started but never checkpointed: start over
    run_dir.mkdir(parents=True)
    cfg = load_config(None, exp.overrides(arm, seed) + [f"run_dir={run_dir}"])
    (run_dir.parent / f"seed{seed}.yaml").write_text(dump_config(cfg))
    return base + ["--config", str(run_dir.parent / f"seed{seed}.yaml")]


def _build_base(overrides: list[str], threads: int | None = None) -> None:
    """Build (or load from the cache) one run's base and, for a foreign arm, its foreign base.

    ``threads`` sets torch's intra-op threads first (a worker process of ``build_shared_base``)."""
    from ..recipes.build import foreign_engine, prepare_run

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    cfg = load_config(None, overrides)
    task, policy, pool, _ = prepare_run(cfg)
    pool.close()
    if cfg.rollout.foreign_fraction > 0:
        foreign_engine(cfg, task, policy)


def build_shared_base(exp: Experiment, console, jobs: int = 1) -> None:
    """Build (or find cached) each seed's base and foreign base once, before parallel runs would each build them.

    Arms that differ only in shift or objective share a base; the cache key is the task and model settings.
    With ``jobs`` > 1 the distinct bases are built ``jobs`` at a time, each in a process of one thread, as the
    runs themselves are: an SFT of these small models gains little from a second thread, so two one-thread builds
    use the two cores better than one two-thread build. Two builds that meet on one cache entry are safe: each
    writes a temporary folder and renames it (``policy.base.default_base``).
    """
    from ..recipes.build import task_key

    seen, todo = set(), []
    for seed in (exp.seeds + exp.tune_seeds if exp.per_seed_base else exp.seeds[:1]):
        for arm in exp.run_arms:
            cfg = load_config(None, exp.overrides(arm, seed))
            # foreign_model is a name or a mapping of model settings: as JSON text either one can be a key
            foreign = json.dumps(cfg.rollout.foreign_model, sort_keys=True, default=str) if cfg.rollout.foreign_fraction > 0 else None
            key = (repr(task_key(cfg)), cfg.model.model_dump_json(), foreign)
            if key in seen or not (cfg.model.path is None or cfg.rollout.foreign_fraction > 0):
                continue
            seen.add(key)
            todo.append((seed, arm, exp.overrides(arm, seed)))
    if jobs <= 1 or len(todo) <= 1:
        for seed, arm, overrides in todo:
            console.print(f"[dim]seed {seed}, {arm}: building or loading the cached base models…[/dim]")
            _build_base(overrides)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    console.print(f"[dim]building or loading {len(todo)} cached base models, {jobs} at a time…[/dim]")
    # spawn: a fork of a process that already ran torch can deadlock in its thread pools
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for f in [ex.submit(_build_base, overrides, 1) for _, _, overrides in todo]:
            f.result()  # a failed build raises here, before any run starts


def run_experiment(exp: Experiment, out: Path, *, jobs: int = 2, console=None) -> dict:
    """Run every (arm, seed) not yet done, ``jobs`` at a time. Returns {"done", "failed", "wall_s"}.

    Each run's stdout/stderr goes to ``<run_dir>.log``. A failed run is reported, the others go on.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    root = out / exp.name
    root.mkdir(parents=True, exist_ok=True)
    from .report import git_commit

    (root / "experiment.yaml").write_text(yaml.safe_dump(
        {"description": exp.description, "seeds": exp.seeds, "arms": exp.arms, "per_seed_base": exp.per_seed_base,
         "compare": [list(c) for c in exp.compare], "preflight_only": exp.preflight_only,
         **({"tune": {"arms": exp.tune_arms, "seeds": exp.tune_seeds}} if exp.tune_arms else {}), "commit": git_commit(),
         "command": f"trustbatch lab run {exp.source or exp.name} --out {out} --jobs {jobs}"}, sort_keys=False))
    todo = exp.runs
    build_shared_base(exp, console, jobs=jobs)
    t0 = time.time()
    running: list[tuple[subprocess.Popen, str, int, object]] = []
    failed: list[str] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Progress(TextColumn(f"[bold]lab {exp.name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("runs", total=len(todo))
        queue = list(todo)
        while queue or running:
            while queue and len(running) < jobs:
                arm, seed = queue.pop(0)
                run_dir = root / arm / f"seed{seed}"
                cmd = _command(exp, arm, seed, run_dir)
                if cmd is None:
                    progress.advance(bar)
                    continue
                log = open(run_dir.parent / f"seed{seed}.log", "w")
                running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), arm, seed, log))
            time.sleep(0.5)
            for item in list(running):
                proc, arm, seed, log = item
                if proc.poll() is None:
                    continue
                log.close()
                running.remove(item)
                progress.advance(bar)
                if proc.returncode != 0:
                    failed.append(f"{arm}/seed{seed}")
                    console.print(f"[red]{arm} seed {seed} failed (exit {proc.returncode}); see {root / arm / f'seed{seed}.log'}[/red]")
    wall = time.time() - t0
    (root / "wall_s.txt").write_text(f"{wall:.0f}\n")
    return {"done": len(todo) - len(failed), "failed": failed, "wall_s": wall}
