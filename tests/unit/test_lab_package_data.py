"""The bundled experiments are package data: the files under src/trustbatch/lab/experiments, each one that the
wheel's package-data pattern in pyproject.toml takes, read by name through importlib.resources."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from trustbatch.lab import load_experiment
from trustbatch.lab.experiment import bundled_experiments

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "src" / "trustbatch" / "lab" / "experiments"


def test_bundled_experiments_are_the_files_of_the_package_folder():
    on_disk = sorted(p.stem for p in FOLDER.glob("*.yaml"))
    assert {"clip", "confirm_fp8", "reference"} <= set(on_disk)  # the folder holds the lab's experiments
    assert sorted(bundled_experiments()) == on_disk
    exp = load_experiment("confirm_fp8")
    assert Path(exp.source).resolve() == (FOLDER / "confirm_fp8.yaml").resolve()
    assert not list((ROOT / "examples" / "lab").glob("*.yaml"))  # moved, not copied


def test_pyproject_ships_every_bundled_experiment():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["trustbatch.lab"]
    missed = [p.name for p in FOLDER.glob("*.yaml")
              if not any(fnmatch.fnmatch(str(p.relative_to(FOLDER.parent)), pat) for pat in patterns)]
    assert not missed, f"bundled experiments the wheel would leave out: {missed}"
