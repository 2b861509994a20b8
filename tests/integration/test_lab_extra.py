"""The lab is an extra (``trustbatch[lab]``): without scipy the core still imports and trains, and every
``trustbatch lab`` command refuses with one line naming the extra.

Each case is a fresh interpreter whose ``sitecustomize`` marks the blocked modules as absent (``sys.modules[name] =
None``: ``import`` fails and ``importlib.util.find_spec`` answers None, as for a package that is not installed),
in every process the run starts too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import TINY

ROOT = Path(__file__).resolve().parents[2]


def _python(tmp_path: Path, blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "TRUSTBATCH_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_core_imports_without_the_lab_and_lab_commands_refuse_in_one_line(tmp_path):
    out = tmp_path / "rep"
    script = (
        "import importlib.util, sys\n"
        "import trustbatch.recipes.train, trustbatch.lab.report\n"
        "from typer.testing import CliRunner\n"
        "from trustbatch.cli import app, main\n"
        "print([importlib.util.find_spec(m) for m in ('scipy', 'matplotlib')])\n"
        "print(CliRunner().invoke(app, ['lab', 'report', '--help']).exit_code)\n"  # help needs no extra
        f"sys.argv = ['trustbatch', 'lab', 'report', '--runs', 'docs/lab2/archive', '--out', {str(out)!r}]\n"
        "main()\n")
    r = _python(tmp_path, ("scipy", "matplotlib"), "-c", script)
    assert r.stdout.splitlines() == ["[None, None]", "0"], (r.stdout, r.stderr)  # the block held; help worked
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "trustbatch: error: the lab needs the lab extra: pip install 'trustbatch[lab]' (scipy, matplotlib not installed)"], r.stderr
    assert not out.exists()


def test_training_runs_without_scipy(tmp_path):
    run = tmp_path / "run"
    r = _python(tmp_path, ("scipy",), "-m", "trustbatch", "train", *TINY, "train.steps=2", "threads=1",
                "reward.workers=0", f"run_dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "summary.json").is_file() and (run / "plot.png").stat().st_size > 1000
