"""Issue 37 (item 7): the default config's base ships with the package, so a fresh machine skips the build.

The shipped folder's key is recomputed here from the default config as ``policy.base`` documents it (sha256 of the
sorted-key JSON of format, task and model settings, first 16 hex digits), and every file's sha256 with hashlib.
"""

import hashlib
import shutil
import tomllib
from pathlib import Path

import pytest

from trustbatch.policy import base as base_mod
from trustbatch.policy.shipped import SHIPPED_DIR, shipped_base

from shipped import default_key, shipped

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_base_is_the_default_configs():
    key, task, model = default_key()
    folder, manifest = shipped()
    fix = "the default config changed: rebuild the shipped base with its manifest's command"
    assert folder.name == f"chain_sum-{key}", fix
    assert manifest["key"] == key and manifest["task"] == task and manifest["model"] == model, fix
    assert manifest["format"] == base_mod.BASE_FORMAT
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    assert {p.name for p in folder.iterdir()} == {"BASE.json", *manifest["sha256"]}
    assert "trustbatch sft" in manifest["command"]


def test_the_wheel_takes_the_shipped_files():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    pkg = ROOT / "src" / "trustbatch" / "policy"
    taken = {p for g in globs["trustbatch.policy"] for p in pkg.glob(g)}
    folder, _ = shipped()
    assert set(folder.iterdir()) <= taken


@pytest.mark.parametrize("damage", ["weights", "key"])
def test_a_shipped_base_with_other_bytes_or_another_key_is_refused(tmp_path, damage):
    folder, manifest = shipped()
    root = tmp_path / "bases"
    shutil.copytree(folder, root / folder.name)
    key = manifest["key"]
    if damage == "weights":
        w = root / folder.name / "model.safetensors"
        data = bytearray(w.read_bytes())
        data[-1] ^= 1
        w.write_bytes(bytes(data))
        path, why = shipped_base("chain_sum", key, root)
        assert path is None and "model.safetensors" in why
    else:
        other = root / f"chain_sum-{'0' * 16}"
        (root / folder.name).rename(other)  # a folder named for another key whose manifest still says the old one
        path, why = shipped_base("chain_sum", "0" * 16, root)
        assert path is None and key in why
    assert shipped_base("chain_sum", key, SHIPPED_DIR) == (folder, "")
    assert shipped_base("chain_sum", "f" * 16, SHIPPED_DIR)[0] is None
