"""``bench/learner_profile.py --device cpu`` runs from the checkout and accounts for the whole step, and (slow)
``bench/gpu_check.py --device cpu`` dry-runs every section (issue 44).

The script runs in a fresh interpreter on a toy 0.5B-shaped step (one layer, V = 1,024). Independent checks: the
classes cover the profiled wall time exactly once (shares sum to 1), and the parts the step certainly has — the
decoder's matmuls, the LM head (chunked: C = 8 > chunk 4), AdamW — each take time.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_learner_profile_runs_on_the_cpu_and_its_shares_cover_the_step():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "learner_profile.py"), "--device", "cpu", "--layers", "1",
                        "--vocab", "1024", "--rows", "2", "--prompt", "8", "--completion", "8", "--chunk", "4",
                        "--micro-batch", "1", "--steps", "1", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    line = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("{")))
    shares = line["shares"]
    assert set(shares) == {"matmul", "attention", "norm_activation", "lm_head", "optimizer", "casts", "other", "idle"}
    assert abs(sum(shares.values()) - 1.0) < 1e-3
    assert min(shares["matmul"], shares["lm_head"], shares["optimizer"]) > 0
    assert line["params"] > 10_000_000  # Qwen2.5-0.5B's layer shape (hidden 896, intermediate 4,864), one layer


@pytest.mark.slow  # 1–3 min on 2 shared cores: every section of the GPU check at toy sizes
def test_gpu_check_dry_runs_on_the_cpu(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--out",
                        str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    sections = {x["section"] for x in lines}
    assert sections == {"env", "learner", "padding_free", "profile", "engine", "fsdp2_ws1", "logprob_memory", "train",
                        "compile"}
    assert [x for x in lines if "error" in x or x.get("returncode", 0) != 0] == []
