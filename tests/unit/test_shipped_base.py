"""Issue 37 (item 7): the default config's base ships with the package, so a fresh machine skips the build.

The shipped folder's key is recomputed here from the default config as ``policy.base`` documents it (sha256 of the
sorted-key JSON of format, task and model settings, first 16 hex digits), and every file's sha256 with hashlib.
"""

import hashlib
import json
import shutil
import tomllib
from pathlib import Path

import pytest

from trustbatch.config import load_config
from trustbatch.policy import base as base_mod
from trustbatch.recipes import task_key
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


def _key(overrides: list[str]) -> str:
    cfg = load_config(None, overrides)
    return base_mod.base_key(task_key(cfg), cfg.model.model_dump(mode="json"))


# evaluation, RL and held-out settings up to the reserve: the base's SFT reads none of them
SAME_BASE = ["task.heldout_size=32", "task.heldout_size=1", "task.heldout_reserve=100", "eval.every=5",
             "eval.samples_per_prompt=8", "eval.temperature=0.7", "train.lr=1e-4", "train.steps=7",
             "objective.name=grpo", "rollout.group_size=4", "rollout.max_new_tokens=8", "model.lora.r=4", "reward.workers=0", "threads=1"]


@pytest.mark.parametrize("override", SAME_BASE)
def test_what_the_sft_does_not_read_keeps_the_shipped_key(override):
    assert _key([override]) == default_key()[0]


@pytest.mark.parametrize("overrides, moved", [
    (["task.heldout_size=300"], "task.heldout_size (256 -> 300)"),  # the SFT skips the 300 held-out prompts
    (["task.heldout_reserve=400"], "task.heldout_size (256 -> 400)"),
    (["task.train_size=100"], "task.train_size (3500 -> 100)"),
    (["model.sft_steps=10"], "model.sft_steps (600 -> 10)"),
])
def test_a_setting_the_sft_reads_moves_the_key_and_the_build_names_it(tmp_path, monkeypatch, overrides, moved):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path))
    cfg = load_config(None, overrides)
    key = _key(overrides)
    _, task, model = default_key()
    name, value = moved.split(" (")[0].split("."), int(moved.split("-> ")[1].rstrip(")"))
    want = {"task": dict(task), "model": dict(model)}
    want[name[0]][name[1]] = value  # the key by hand: the shipped base's settings with this one moved
    blob = json.dumps({"format": base_mod.BASE_FORMAT, **want}, sort_keys=True)
    assert key == hashlib.sha256(blob.encode()).hexdigest()[:16] != default_key()[0]
    folder, why = base_mod.find_base("chain_sum", task_key(cfg), cfg.model.model_dump(mode="json"))
    assert folder is None and why.endswith(f"the shipped chain_sum base was built with other {moved}"), why


def test_the_sft_never_reads_a_heldout_prompt_and_reads_what_the_shipped_base_read():
    """With 32 prompts held out the SFT still reads the prompts after the first 256 (as the shipped base's did):
    the distinct reasoning-gym questions counted here by hand."""
    import reasoning_gym

    cfg = load_config(None, ["task.heldout_size=32", "task.train_size=100"])
    from trustbatch.recipes import configured_task

    task = configured_task(cfg)
    split = base_mod.sft_split(task, task_key(cfg))
    pool = reasoning_gym.create_dataset("chain_sum", size=2 * (100 + 256), seed=1, **cfg.task.params)
    distinct = list(dict.fromkeys(entry["question"] for entry in pool))
    assert [e.prompt for e in split.train] == distinct[256:356]
    assert [e.prompt for e in task.heldout] == distinct[:32]  # the run's held-out prompts: none of them trained on
