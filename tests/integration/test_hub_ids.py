"""Issue 45 item 3: ``model.path`` takes a Hugging Face Hub id, resolved from the hub cache as transformers does, offline.

The cache is laid out here as huggingface_hub lays it out (``models--OWNER--NAME/snapshots/COMMIT`` and
``refs/BRANCH``), from the local stories260K model, and the real ``trustbatch train`` reads it with
``HF_HUB_OFFLINE=1``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runproc import ROOT, one_line

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = [{"problem": f"Tom has {i} pens and buys {i % 5 + 1} more. How many pens?", "answer": i + i % 5 + 1}
        for i in range(24)]


@pytest.fixture
def hub_cache(tmp_path, shared_dir):
    cache = tmp_path / "hub"
    snap = cache / "models--tbtest--stories260K" / "snapshots" / COMMIT
    shutil.copytree(shared_dir / "models" / "stories260K-hf", snap)
    refs = cache / "models--tbtest--stories260K" / "refs"
    refs.mkdir()
    (refs / "main").write_text(COMMIT)
    return cache


def _train(tmp_path, hub_cache, *extra):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [sys.executable, "-m", "trustbatch", "train", f"data={data}", "data.heldout_size=4", "train.steps=1",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "reward.workers=0",
            "eval.samples_per_prompt=1", "threads=1", f"run_dir={tmp_path / 'run'}", *extra]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_a_hub_id_trains_from_the_offline_hub_cache(tmp_path, hub_cache, shared_dir):
    done = _train(tmp_path, hub_cache, "model.path=tbtest/stories260K")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model=tbtest/stories260K" in done.stdout
    from safetensors.torch import load_file

    # the run started from the cached snapshot's weights: the step-0 checkpoint holds them unchanged
    base = load_file(str(shared_dir / "models" / "stories260K-hf" / "model.safetensors"))
    step0 = load_file(str(tmp_path / "run" / "checkpoints" / "step_000000" / "model.safetensors"))
    assert base.keys() == step0.keys() and all(bool((base[k] == step0[k]).all()) for k in base)


def test_a_missing_hub_id_is_one_line_naming_it_and_the_offline_state(tmp_path, hub_cache):
    done = _train(tmp_path, hub_cache, "model.path=tbtest/nothing-here")
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert "'tbtest/nothing-here'" in line and "HF_HUB_OFFLINE=1" in line
    # the download command it names is one the installed huggingface_hub provides, beside this interpreter
    program = line.rsplit("(", 1)[1].split()[0]
    assert "(hf download tbtest/nothing-here)" in line and (Path(sys.executable).parent / program).exists()
