"""``trustbatch lab archive``: keep what the report reads, drop the checkpoints.

A lab run directory is mostly checkpoints (about 1 GB per session); the report reads only small
files. Archiving those into a folder that can be committed lets ``trustbatch lab report --runs
ARCHIVE`` rebuild the report after the machine that ran the experiments is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError

# What load_runs, experiment_section and the pre-flight table read, relative to OUT/EXPERIMENT/.
EXPERIMENT_FILES = ("experiment.yaml", "preflight.json", "wall_s.txt", "calls.jsonl")
RUN_FILES = ("summary.json", "metrics.jsonl", "ratios.jsonl", "steps.jsonl")


def archive_experiment(exp_dir: Path, dest: Path) -> int:
    """Copy one experiment's report inputs from ``exp_dir`` into ``dest`` (replaced as a whole). Returns bytes copied.

    Copied: the experiment's ``experiment.yaml``, ``preflight.json``, ``wall_s.txt`` and ``calls.jsonl``; each arm's
    ``seedK.yaml`` (the resolved config); each run's ``summary.json``, ``metrics.jsonl`` and
    ``ratios.jsonl``. Symlinked arms (an ``onpolicy`` arm linked to a shared reference) are copied
    as files. Runs without a ``summary.json`` (unfinished) are left out.

    The copy is built in a temporary sibling folder and renamed over ``dest``, so an interrupted
    archive leaves the previous one whole.

    Raises:
        UserError: ``exp_dir`` is not a lab experiment folder (no ``experiment.yaml`` nor ``preflight.json``).
    """
    exp_dir = Path(exp_dir)
    if not any((exp_dir / f).exists() for f in EXPERIMENT_FILES[:2]):
        raise UserError(f"{exp_dir} has no experiment.yaml or preflight.json; pass the --out of `trustbatch lab run` as --runs")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    copied = 0
    try:
        for f in EXPERIMENT_FILES:
            if (exp_dir / f).exists():
                copied += _copy(exp_dir / f, tmp / f)
        for arm in sorted(p for p in exp_dir.iterdir() if p.is_dir()):
            for summary in sorted(arm.glob("seed*/summary.json")):
                run = summary.parent
                for f in RUN_FILES:
                    if (run / f).exists():
                        copied += _copy(run / f, tmp / arm.name / run.name / f)
                cfg = arm / f"{run.name}.yaml"
                if cfg.exists():
                    copied += _copy(cfg, tmp / arm.name / cfg.name)
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return copied


def _copy(src: Path, dst: Path) -> int:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)  # follows symlinks: a linked reference arm becomes real files
    return dst.stat().st_size


def archive_runs(runs: Path, out: Path, experiments: list[str] | None = None) -> dict[str, int]:
    """Archive each experiment under ``runs`` (all by default) into ``out/EXPERIMENT``. Returns {experiment: bytes}.

    Raises:
        UserError: ``runs`` does not exist, or a named experiment is not under it.
    """
    runs, out = Path(runs), Path(out)
    if not runs.is_dir():
        raise UserError(f"--runs {runs} is not a folder; pass the --out of `trustbatch lab run`")
    names = experiments or sorted(p.name for p in runs.iterdir() if (p / "experiment.yaml").exists() or (p / "preflight.json").exists())
    missing = [n for n in names if not (runs / n).is_dir()]
    if missing:
        raise UserError(f"no experiment folder {', '.join(missing)} under {runs}; run `trustbatch lab run` first or fix the name")
    return {n: archive_experiment(runs / n, out / n) for n in names}
