"""What `pip install trustbatch` gets: the wheel built from this tree holds every file of the package, and the default
`trustbatch train` runs from the installed copy, far from the checkout, on the base the wheel ships (no SFT build).

The package-data patterns are checked by name in tests/unit (test_shipped_base, test_lab_package_data); this builds
the wheel with pip, as a release would, and runs what it installed."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "trustbatch"


def test_the_wheel_holds_the_package_and_its_default_train_runs_on_the_shipped_base(tmp_path):
    # built from a copy: pip builds in the source tree, whose build/ and egg-info from an earlier build would
    # carry files the package-data patterns no longer take (and the checkout stays as it was)
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # the build backend (setuptools >= 77, pyproject.toml) comes from the package index in an isolated environment
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("trustbatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert tree - names == set(), f"files of src/trustbatch the wheel leaves out: {sorted(tree - names)}"

    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                                str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(site), TRUSTBATCH_CACHE=str(tmp_path / "cache"))
    where = subprocess.run([sys.executable, "-c", "import trustbatch; print(trustbatch.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr

    run = subprocess.run([sys.executable, "-m", "trustbatch", "train", "train.steps=1", "reward.workers=0",
                          f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file() and "round 1/1" in run.stdout, run.stdout
    # the base came from the wheel: its manifest, byte for byte, copied into the cache (a build writes its own)
    shipped, = (site / "trustbatch" / "policy" / "bases").iterdir()
    cached = list((tmp_path / "cache").rglob("BASE.json"))
    assert [p.parent.name for p in cached] == [shipped.name], cached
    assert cached[0].read_bytes() == (shipped / "BASE.json").read_bytes()
