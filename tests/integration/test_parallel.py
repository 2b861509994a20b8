"""Data parallelism: two gloo ranks under DDP give the one-process gradient of the whole batch, and the same weights.

Also: micro-batching through the learner does not change the gradient (the batch statistics an
objective declares cover the whole optimizer batch), and a 2-rank ``torchrun`` of ``trustbatch train``
finishes, its header printed once and naming the world size, as summary.json and ``trustbatch report`` do.
"""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.forward import pack
from trustbatch.trainer.learner import Learner
from trustbatch.parallel import World

from gloo_ranks import two_gloo_ranks
from grad_probe import sgd_recording_grads
from runproc import cache  # noqa: F401

OBJECTIVES = ["p3o", "p3o_two_anchor", "grpo"]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-6) -> None:
    """Max abs difference within ``tol`` of the tensor's own scale (log-probs are float32, so round-off is ~1e-7)."""
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= tol * scale + 1e-12, f"{what}: max |diff| {err:.3g} vs scale {scale:.3g}"


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).double()


def _batch(B=5) -> TrainBatch:
    """Off-policy rows with unequal prompt and completion lengths (so the ranks' token counts differ)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(B)]
    comps = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (1, 7, 3, 6, 2, 5, 4)[:B]]
    packed = pack(prompts, comps, pad_id=0)
    C = packed.response_mask.shape[1]
    blp = -3.0 + 0.8 * torch.randn(B, C, generator=g, dtype=torch.float64)
    prox = blp + 0.3 * torch.randn(B, C, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return TrainBatch(packed, blp, adv, torch.zeros(B, dtype=torch.long), proximal_logprobs=prox)


def _step(objective: str, world: World | None, micro_batch_size: int):
    """One optimizer step; returns (gradients before the step, weights after it, the step's ratio quantiles)."""
    model = _model()
    learner = Learner(model, objective, {}, lr=1e-2, grad_clip=1e9, micro_batch_size=micro_batch_size, world=world)
    grads = sgd_recording_grads(learner, model)
    batch = _batch()
    if world is not None and world.size > 1:
        batch = batch.select(world.shard(len(batch)))
    out = learner.step(batch)
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, (out["ratio_p50"], out["ratio_p99"])


# objectives with a no-grad pass before the steps (the proximal snapshot, the reference's log-probs)
PRE_PASS = {"1 row, p3o_two_anchor": ("p3o_two_anchor", {}), "1 row, p3o+ref_kl": ("p3o", {"ref_kl_coef": 0.1})}


def _one_row_round(case: str, world: World | None):
    """train_on of a 1-row batch (DAPO's dynamic sampling can shrink a round to fewer rows than ranks): rank 1's
    share is empty. Returns the weights after it."""
    objective, options = PRE_PASS[case]
    model = _model()
    learner = Learner(model, objective, options, lr=1e-2, grad_clip=1e9, micro_batch_size=2, world=world)
    learner.train_on(_batch(B=1))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ddp_steps(world: World, out_dir: Path) -> dict:
    return ({name: _step(name, world, micro_batch_size=2) for name in OBJECTIVES}
            | {case: _one_row_round(case, world) for case in PRE_PASS})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return two_gloo_ranks(_ddp_steps, tmp_path_factory.mktemp("ddp"))


def test_the_ranks_hold_unequal_token_counts():
    b = _batch()
    w0, w1 = (World(rank=r, size=2) for r in range(2))
    n0 = int(b.select(w0.shard(len(b))).packed.response_mask.sum())
    n1 = int(b.select(w1.shard(len(b))).packed.response_mask.sum())
    assert n0 != n1 and n0 + n1 == int(b.packed.response_mask.sum())
    # with micro-batches of 2 rows, rank 0 runs 2 micro-batches and rank 1 one, plus an empty one
    assert len(range(*w0.shard(5).indices(5))) == 3 and len(range(*w1.shard(5).indices(5))) == 2


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_two_gloo_ranks_equal_one_process_on_the_whole_batch(two_ranks, objective):
    want_grads, want_weights, want_q = _step(objective, None, micro_batch_size=64)
    for rank in range(2):
        grads, weights, q = two_ranks[rank][objective]
        for n in want_grads:
            _close(grads[n], want_grads[n], f"{objective} grad {n} rank {rank}")
            _close(weights[n], want_weights[n], f"{objective} weight {n} rank {rank}")
        assert q == pytest.approx(want_q, rel=1e-6)  # the quantiles of every rank's tokens, not a mean of shares
    # the gradient is not trivially equal: a 1/world-size slip would show
    assert max(g.abs().max() for g in want_grads.values()) > 1e-3


@pytest.mark.parametrize("case", list(PRE_PASS))
def test_a_rank_with_no_rows_trains_as_one_process_with_a_pre_pass(two_ranks, case):
    """The proximal snapshot and the reference's log-probs concatenated no chunks on a rank whose share was empty
    (torch.cat of an empty list: the run died at 3 ranks when DAPO kept 1 group of 2). Reference: one process."""
    want = _one_row_round(case, None)
    assert max(float((w - p).abs().max()) for w, p in zip(want.values(), _model().state_dict().values())) > 1e-4
    for rank in range(2):
        for n in want:
            _close(two_ranks[rank][case][n], want[n], f"{case} weight {n} rank {rank}")


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("mbs", [1, 2, 3])
def test_micro_batches_give_the_one_micro_batch_gradient(objective, mbs):
    want, _, _ = _step(objective, None, micro_batch_size=64)
    got, _, _ = _step(objective, None, micro_batch_size=mbs)
    for n in want:
        _close(got[n], want[n], f"{objective} mbs={mbs} {n}")


def test_torchrun_two_ranks_trains(tmp_path):
    from tiny import TINY

    run = tmp_path / "run"
    env = {**os.environ, "TRUSTBATCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trustbatch", "train", *TINY, "train.steps=2", "threads=1", f"run_dir={run}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # base evaluation and two rounds, written once (by rank 0)
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    out = p.stdout.splitlines()
    assert sum(line.startswith("trustbatch train ") for line in out) == 1, p.stdout  # rank 0 alone prints
    assert out.count("device cpu, precision float32, strategy ddp, world size 2") == 1, p.stdout
    assert not [line for line in out if "slower than float32" in line]

    from trustbatch.recipes.compare import write_comparison

    page = write_comparison([run], tmp_path / "cmp").read_text()
    lines = page.splitlines()
    table = lines[lines.index("| run | rounds | base | final | best | wall time | world size |"):]
    assert table[2].startswith("| run |") and table[2].strip("| ").split(" | ")[-1] == "2"


def test_one_process_says_where_it_runs_and_that_bf16_mixed_is_slow_on_the_cpu(tmp_path, cache):  # noqa: F811
    from rich.console import Console

    from trustbatch.config import load_config
    from trustbatch.recipes import train
    from tiny import TINY

    out = io.StringIO()
    summary = train(load_config(None, TINY + ["train.steps=1", "threads=1", "reward.workers=0", "train.device=cpu",
                                              "train.precision=bf16-mixed", f"run_dir={tmp_path / 'run'}"]),
                    console=Console(file=out, width=80, soft_wrap=True))
    lines = out.getvalue().splitlines()
    assert "device cpu, precision bf16-mixed, strategy ddp, world size 1" in lines
    warned = [line for line in lines if "slower than float32" in line]
    assert len(warned) == 1 and "train.precision=bf16-mixed" in warned[0] and "train.precision=float32" in warned[0]
    assert summary["world_size"] == 1 == json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"]
