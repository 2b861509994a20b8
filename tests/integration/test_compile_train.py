"""``trustbatch train train.compile=true`` through the real command: round 1 equals the eager run's.

Reference: the same tiny job without ``train.compile``. Round 1 samples from the same initial weights with the same
seeds (the rollout engine shares the module, and no-grad forwards stay eager), so the batch is the same (equal
rewards); the learner's compiled training forward differs from the eager one only by the float32 round-off of
inductor's fused kernels, so its metrics agree within 1e-5 and the on-policy ESS is 1 within 1e-6. Inductor writes
the code it generates to ``TORCHINDUCTOR_CACHE_DIR``, which shows the compiled path ran. The same holds under
``torchrun --nproc-per-node 2`` (gloo) with FSDP2 and DDP. All three are slow (``make test-slow``). One eager run in one process is the
reference for all three: two ranks of the eager step equal one process (tests/integration/test_fsdp2_end_to_end.py,
test_parallel.py) to float32 reduction order, well inside 1e-5, and one eager launch fewer keeps ``make test`` short.
"""

import json
import os
import subprocess
import sys

import pytest

from runproc import ROOT, cache  # noqa: F401
from tiny import TINY

COMPARED = ("loss", "grad_norm", "entropy", "ess")


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _round_one(tmp_path, compile_: bool, strategy: str | None = None) -> dict:
    run = tmp_path / f"run-{compile_}-{strategy}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    launch = [*TORCHRUN, "-m", "trustbatch", "train", f"train.strategy={strategy}"] if strategy else \
        [sys.executable, "-m", "trustbatch", "train"]
    p = subprocess.run([*launch, *TINY, "train.steps=1", "eval.every=100",
                        "threads=1", f"train.compile={str(compile_).lower()}", f"run_dir={run}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1)


def _generated(tmp_path) -> int:
    return sum(f.suffix == ".py" for f in (tmp_path / "inductor").rglob("*"))


@pytest.fixture(scope="module")
def eager(tmp_path_factory, cache):  # noqa: F811
    tmp_path = tmp_path_factory.mktemp("eager")
    row = _round_one(tmp_path, False)
    assert _generated(tmp_path) == 0
    return row


# slow (make test-slow; 30 s of the default suite's 10 minutes each): inductor's C++ compile. The default suite keeps
# the compiled step against the eager one in tests/unit/test_compile_blocks.py (aot_eager: the same graph capture
# and AOT autograd, eager kernels) and runs inductor on CUDA in tests/gpu
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [None, "fsdp2", "ddp"],
                         ids=["one_process", "fsdp2_2_ranks", "ddp_2_ranks"])
def test_a_compiled_round_equals_the_eager_one(tmp_path, eager, strategy):
    compiled = _round_one(tmp_path, True, strategy)
    assert _generated(tmp_path) > 0, "inductor generated no code"
    for k in ("reward_mean", "num_tokens", "truncated_fraction"):  # the same samples
        assert compiled[k] == eager[k], (k, compiled[k], eager[k])
    assert abs(compiled["ess"] - 1.0) < 1e-6, compiled["ess"]
    for k in COMPARED:
        assert abs(compiled[k] - eager[k]) <= 1e-5 * max(1.0, abs(eager[k])), (k, compiled[k], eager[k])
