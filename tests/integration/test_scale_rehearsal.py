"""The default settings fit a Qwen2.5-0.5B-shaped model in 24 GiB: the real `trustbatch train` command, one round.

The model is ``bench/scale_rehearsal.py``'s (random init; hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4,864, V = 151,936, tied embeddings; saved with ``save_pretrained`` and loaded by ``model.path``), and the command
is its ``defaults`` arm: nothing set but the model, the round's shape (2 prompts × 4 samples × 256 new tokens, one
round), two held-out prompts and an in-process reward. So the learner runs float32 without checkpointing at the
default micro-batch (512 rows: the whole batch of 8) and LM-head chunk (``auto``: 441 tokens, where B · (C + 1) =
2,056 positions would be 1.2 GB per [tokens, V] float32 tensor on the full path), with the default held-out
evaluations (rounds 0 and 1) and checkpoints (step 0 and the last). The peak is the trainer process's own
``ru_maxrss``, from ``os.wait4`` on exactly that process.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parents[2] / "bench"
LIMIT_GIB = 24.0


@pytest.mark.slow
def test_default_settings_fit_a_05b_shaped_model_in_24_gib(tmp_path):
    sys.path.insert(0, str(BENCH))
    from scale_rehearsal import overrides

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    model_dir = tmp_path / "qwen25-05b-shaped"
    # built in its own process, so that this one does not hold the model's 2 GB beside the trainer
    subprocess.run([sys.executable, "-c", f"from pathlib import Path; from scale_rehearsal import build_model_dir; "
                    f"build_model_dir(Path({str(model_dir)!r}))"], env=env, check=True)
    run_dir = tmp_path / "run"
    args = overrides("defaults", model_dir, run_dir, new_tokens=256, rounds=1, threads=1)
    memory_keys = ("train.micro_batch_size", "train.logprob_chunk_size", "train.precision", "train.activation_",
                   "train.strategy", "eval.", "checkpoint_every", "rollout.engine", "rollout.precision", "model.")
    assert not any(a.startswith(memory_keys) for a in args[1:]), args  # args[0] is model.path
    t = time.perf_counter()
    with open(tmp_path / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trustbatch", "train", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    peak_gib = usage.ru_maxrss / 2**20  # KiB on Linux
    print(json.dumps({"peak_rss_gib": round(peak_gib, 2), "wall_s": round(wall, 1)}))
    assert proc.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
    train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]  # the settings the run resolved
    assert (train["logprob_chunk_size"], train["micro_batch_size"], train["precision"]) == ("auto", 512, "float32")
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rounds if r.get("step") == 1 and "step_s" in r]
    assert trained and trained[0]["response_length"] > 0, rounds[-1]
    assert 2.0 < peak_gib < LIMIT_GIB, peak_gib  # above 2: the float32 weights alone are 1.8 GiB
