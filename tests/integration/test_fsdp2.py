"""FSDP2: two gloo ranks with ``fully_shard`` per decoder block give the one-process gradient of the whole batch.

Also: FSDP2's bf16 mixed precision is compared with one process under bf16 autocast; an FSDP2
checkpoint (whole weights and optimizer state gathered to rank 0) restores exactly at world size 1,
and loads back into sharded ranks; one written before the first step counts no AdamW step; with frozen parameters
the saved state is indexed by the optimizer's own (trainable) parameters; a 2-rank ``torchrun`` of ``trustbatch
train train.strategy=fsdp2`` finishes and resumes in one process (end to end against one process, and a kill -9
resume at 2 ranks: test_fsdp2_end_to_end.py). All on CPU with gloo: FSDP2 on CUDA with NCCL was not run here.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trustbatch.trainer.learner import Learner
from trustbatch.parallel import World, decoder_blocks

from grad_probe import sgd_recording_grads
from gloo_ranks import two_gloo_ranks
from test_parallel import _batch, _close

# (objective, rows in the batch, micro-batch size): with 5 rows rank 0 runs two micro-batches and
# rank 1 one plus an empty one (and P3O's batch statistics pass pads likewise); with 7 both run two
CASES = [("p3o", 5, 2), ("grpo", 7, 2)]
# bf16 keeps 8 significant bits (relative spacing 2^-8 = 3.9e-3). FSDP2's mixed precision casts every
# weight and the activations between blocks to bf16; autocast casts only the matmuls' inputs and keeps the
# residual stream in float32; so the two differ by a few bf16 roundings. Measured on CASES (max |diff| over
# each tensor's max |value|): gradients 1.6e-2 (p3o) and 2.1e-2 (grpo), median 9e-3, about 2 bf16 spacings;
# weights after the SGD step (lr 0.5) 1.1e-2 and 0.7e-2. Autocast itself is 1.0e-2 .. 1.5e-2 off float32,
# so these bounds (about 2.5x the measurements) catch a lost or doubled gradient share, a missing reduction
# or a wrong scale, not a bf16 rounding detail.
BF16_GRAD_TOL, BF16_WEIGHT_TOL = 5e-2, 3e-2


def _model(dtype=torch.float32):
    """Two blocks (so that FSDP2 has units of its own besides the root) and a tied LM head, as the default base has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype)


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(objective: str, rows: int, world: World | None, micro_batch_size: int, param_dtype=None, autocast=False):
    """One SGD step; returns (whole gradients before the step, whole weights after it)."""
    model = _model()
    learner = Learner(model, objective, {}, lr=1e-2, grad_clip=1e9, micro_batch_size=micro_batch_size, world=world,
                      strategy="fsdp2", param_dtype=param_dtype)
    grads = sgd_recording_grads(learner, model)
    batch = _batch(rows)
    if world is not None and world.size > 1:
        batch = batch.select(world.shard(len(batch)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        learner.step(batch)
    return ({n: _whole(g) for n, g in grads.items()},
            {n: _whole(p.detach()).clone() for n, p in model.named_parameters()})


def _checkpoint(world: World, out_dir: Path) -> dict:
    """Two AdamW steps, then the checkpoint as the trainer writes it, and the state gathered independently."""
    from trustbatch.trainer.checkpoint import save_checkpoint
    from trustbatch.parallel import full_model_state

    class Policy:  # save_checkpoint's policy: the model and an HF save (the tokenizer is not under test)
        def __init__(self, model):
            self.model = model

        def save(self, path, state_dict=None):
            self.model.save_pretrained(path, state_dict=state_dict)

    model = _model()
    learner = Learner(model, "p3o", {}, lr=1e-2, micro_batch_size=2, world=world, strategy="fsdp2", warmup_steps=4)
    batch = _batch(5)
    for _ in range(2):
        learner.step(batch.select(world.shard(len(batch))))
    model_state = full_model_state(model)
    state = {"learner": learner.state_dict()}
    # independently: each parameter's and each Adam moment's shards all-gathered (DTensor.full_tensor)
    gathered = {"weights": {n: _whole(p.detach()).clone() for n, p in model.named_parameters()},
                "adam": {n: {k: _whole(v).clone() for k, v in learner.optimizer.state[p].items()}
                         for n, p in model.named_parameters()},
                "scheduler": learner.scheduler.state_dict(), "version": learner.version}
    if world.is_main:
        save_checkpoint(out_dir / "run", 2, Policy(model), state, model_state=model_state)
        torch.save(gathered, out_dir / "gathered.pt")
    world.barrier()
    # and back into two sharded ranks: a fresh learner loads the file's whole state and keeps its shards
    again = Learner(_model(), "p3o", {}, lr=1e-2, micro_batch_size=2, world=world, strategy="fsdp2", warmup_steps=4)
    saved = torch.load(out_dir / "run" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    again.load_state_dict(saved["learner"])
    return {"adam": {n: {k: _whole(v).clone() for k, v in again.optimizer.state[p].items()}
                     for n, p in again.model.named_parameters()},
            "version": again.version, "lr": again.scheduler.get_last_lr(), "before_any_step": _step0(world),
            "partly_frozen": _partly_frozen(world)}


def _partly_frozen(world: World) -> dict:
    """One AdamW step with the norms frozen (as LoRA freezes its base): the optimizer holds the other parameters
    only. Its gathered state, each trainable parameter's moments gathered independently, and what a fresh sharded
    learner holds after loading that state."""
    def learner():
        model = _model()
        for n, p in model.named_parameters():
            p.requires_grad_("norm" not in n)
        return Learner(model, "p3o", {}, lr=1e-2, micro_batch_size=2, world=world, strategy="fsdp2")

    def moments(lrn):
        return {n: {k: _whole(v).clone() for k, v in lrn.optimizer.state[p].items()}
                for n, p in lrn.model.named_parameters() if p.requires_grad}

    first = learner()
    batch = _batch(5)
    first.step(batch.select(world.shard(len(batch))))
    saved = world.gather(first.state_dict()["optimizer"])[0]
    again = learner()
    again.load_state_dict({**first.state_dict(), "optimizer": saved})
    return {"saved": saved, "trainable": [n for n, p in first.model.named_parameters() if p.requires_grad],
            "adam": moments(first), "reloaded": moments(again)}


def _step0(world: World) -> dict:
    """A checkpoint before the first step (the trainer's step 0), saved and loaded back at two ranks: what each
    optimizer holds afterwards."""
    fresh = Learner(_model(), "p3o", {}, lr=1e-2, micro_batch_size=2, world=world, strategy="fsdp2")
    saved = world.gather(fresh.state_dict())[0]  # rank 0's, as every rank reads it from the file
    again = Learner(_model(), "p3o", {}, lr=1e-2, micro_batch_size=2, world=world, strategy="fsdp2")
    again.load_state_dict(saved)
    return {"saved": saved["optimizer"], "after_save": dict(fresh.optimizer.state),
            "after_load": dict(again.optimizer.state), "groups": again.optimizer.state_dict()["param_groups"]}


def _micro_batch_scope_step(world: World | None, strategy: str = "ddp") -> dict:
    """One SGD step of P3O with ``ess_scope="micro_batch"`` on 5 rows in micro-batches of 2: over two ranks,
    rank 0 runs rows [0, 1] then [2], rank 1 rows [3, 4] then an empty micro-batch, and micro-batch i's
    ESS sums over the ranks' i-th micro-batches. Returns the whole gradients."""
    model = _model()
    learner = Learner(model, "p3o", {}, grad_clip=1e9, micro_batch_size=2, world=world, strategy=strategy,
                      ess_scope="micro_batch")
    grads = sgd_recording_grads(learner, model)
    batch = _batch(5)
    learner.step(batch.select(world.shard(len(batch))))
    return {n: _whole(g) for n, g in grads.items()}


def _fsdp2_runs(world: World, out_dir: Path) -> dict:
    res = {case: _step(*case[:2], world, micro_batch_size=case[2]) for case in CASES}
    res["micro_batch_scope"] = {s: _micro_batch_scope_step(world, s) for s in ("ddp", "fsdp2")}
    res["bf16"] = {case: _step(*case[:2], world, micro_batch_size=case[2], param_dtype=torch.bfloat16)
                   for case in CASES}
    res["reloaded"] = _checkpoint(world, out_dir)
    return res


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp2")
    return d, two_gloo_ranks(_fsdp2_runs, d)


def test_the_blocks_are_found_generically():
    model = _model()
    assert decoder_blocks(model) == list(model.model.layers)
    model._no_split_modules = None  # then model.model.layers
    assert decoder_blocks(model) == list(model.model.layers)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_fsdp2_ranks_equal_one_process_on_the_whole_batch(two_ranks, case):
    _, ranks = two_ranks
    want_grads, want_weights = _step(*case[:2], None, micro_batch_size=64)
    for rank in range(2):
        grads, weights = ranks[rank][case]
        assert sorted(grads) == sorted(want_grads)
        for n in want_grads:
            _close(grads[n], want_grads[n], f"{case} grad {n} rank {rank}")
            _close(weights[n], want_weights[n], f"{case} weight {n} rank {rank}")
    # the gradient is not trivially equal: a 1/world-size slip would show
    assert max(g.abs().max() for g in want_grads.values()) > 1e-3


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_rank_with_fewer_micro_batches_still_sums_micro_batch_statistics(two_ranks, strategy):
    # one process on rows [0, 1, 3, 4] then [2] forms the same micro-batches as the two ranks together
    model = _model()
    learner = Learner(model, "p3o", {}, grad_clip=1e9, micro_batch_size=4, ess_scope="micro_batch")
    want = sgd_recording_grads(learner, model)
    learner.step(_batch(5).select(torch.tensor([0, 1, 3, 4, 2])))
    for rank in range(2):
        got = two_ranks[1][rank]["micro_batch_scope"][strategy]
        for n in want:
            _close(got[n], want[n], f"{strategy} grad {n} rank {rank}")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fsdp2_bf16_mixed_precision_matches_bf16_autocast(two_ranks, case):
    _, ranks = two_ranks
    want_grads, want_weights = _step(*case[:2], None, micro_batch_size=64, autocast=True)
    fp32_grads, _ = _step(*case[:2], None, micro_batch_size=64)
    grads, weights = ranks[0]["bf16"][case]
    for n in want_grads:
        assert weights[n].dtype == torch.float32  # float32 master weights
        _close(grads[n], want_grads[n], f"bf16 {case} grad {n}", tol=BF16_GRAD_TOL)
        _close(weights[n], want_weights[n], f"bf16 {case} weight {n}", tol=BF16_WEIGHT_TOL)
    # the sharded run did compute in bf16: its gradient is off the float32 one by far more than float32 round-off
    off = max(float((grads[n] - fp32_grads[n]).abs().max() / fp32_grads[n].abs().max()) for n in fp32_grads)
    assert off > 1e-4, off


def test_an_fsdp2_checkpoint_resumes_at_world_size_one(two_ranks):
    from transformers import LlamaForCausalLM

    from trustbatch.trainer.checkpoint import load_trainer_state

    d, ranks = two_ranks
    ckpt = d / "run" / "checkpoints" / "step_000002"
    gathered = torch.load(d / "gathered.pt", weights_only=False)
    model = LlamaForCausalLM.from_pretrained(ckpt)
    state = load_trainer_state(ckpt)
    learner = Learner(model, "p3o", {}, lr=1e-2, micro_batch_size=2, warmup_steps=4)
    learner.load_state_dict(state["learner"])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), gathered["weights"][n]), n
        got = learner.optimizer.state[p]
        assert sorted(got) == sorted(gathered["adam"][n]) == ["exp_avg", "exp_avg_sq", "step"], n
        for k, v in gathered["adam"][n].items():
            assert torch.equal(got[k], v), (n, k)
    assert learner.version == gathered["version"] == 2
    assert learner.scheduler.state_dict() == gathered["scheduler"]
    # the same file loaded back into two sharded ranks: each rank's gathered optimizer state is the saved one
    for rank in range(2):
        again = ranks[rank]["reloaded"]
        assert again["version"] == 2 and again["lr"] == learner.scheduler.get_last_lr()
        for n, moments in gathered["adam"].items():
            for k, v in moments.items():
                assert torch.equal(again["adam"][n][k], v), (rank, n, k)


def test_a_checkpoint_before_the_first_step_counts_no_adam_step(two_ranks):
    # torch's gatherer and setter would run an AdamW step with zero gradients on an optimizer without state,
    # leaving step = 1, so that the first real update takes step 2's bias corrections (0.7425x)
    n_params = len(list(_model().parameters()))
    for rank in range(2):
        got = two_ranks[1][rank]["reloaded"]["before_any_step"]
        assert got["after_save"] == {} and got["after_load"] == {}, rank
        assert got["saved"]["state"] == {} and got["saved"]["param_groups"][0]["params"] == list(range(n_params))
        assert got["groups"] == got["saved"]["param_groups"], rank


def test_the_optimizer_state_maps_by_trainable_parameter(two_ranks):
    # with frozen parameters the optimizer's index i is its i-th trainable parameter, not model.named_parameters()'s
    for rank in range(2):
        got = two_ranks[1][rank]["reloaded"]["partly_frozen"]
        names = got["trainable"]
        assert 0 < len(names) < len(list(_model().parameters()))
        assert sorted(got["saved"]["state"]) == list(range(len(names)))
        for i, n in enumerate(names):
            assert sorted(got["saved"]["state"][i]) == ["exp_avg", "exp_avg_sq", "step"], n
            for k, v in got["adam"][n].items():
                assert torch.equal(got["saved"]["state"][i][k], v), (rank, n, k)
                assert torch.equal(got["reloaded"][n][k], v), (rank, n, k)


def _torchrun(run: Path, env: dict, *extra: str) -> list[dict]:
    """A 2-rank ``trustbatch train`` of two rounds; its metrics records (base evaluation and two rounds)."""
    import json

    from tiny import TINY

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trustbatch", "train", *TINY, "train.steps=2", "threads=1", f"run_dir={run}", *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    return records


@pytest.mark.slow
def test_torchrun_fsdp2_trains_as_ddp_does_and_resumes_in_one_process(tmp_path):
    env = {**os.environ, "TRUSTBATCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    ddp = _torchrun(tmp_path / "ddp", env, "train.strategy=ddp")
    fsdp2 = _torchrun(tmp_path / "fsdp2", env, "train.strategy=fsdp2")
    for a, b in zip(ddp[1:], fsdp2[1:]):
        # the same rollouts (the engine's whole copy holds the learner's weights) and the same update, up to
        # float32 summation order (DDP runs the shared-prompt forward, which FSDP2 turns off): measured 4e-6
        # relative in the loss (a sum of cancelling terms), 5e-7 in the gradient norm
        assert a["reward_mean"] == b["reward_mean"] and a["num_tokens"] == b["num_tokens"]
        for k in ("loss", "entropy", "grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-4 * max(abs(a[k]), 1e-3), (k, a[k], b[k])
        assert abs(b["ess"] - 1.0) < 1e-6  # on fresh data the behaviour copy is the policy
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", "--resume", str(tmp_path / "fsdp2"),
                        "train.steps=3"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming" in p.stdout and "step_000002" in p.stdout
    assert len((tmp_path / "fsdp2" / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.slow
def test_torchrun_fsdp2_with_lagged_bf16_rollouts_replay_and_a_two_rank_resume(tmp_path):
    # a bf16 rollout copy served 1 optimizer step late (snapshots gathered after every step), two optimizer steps
    # per round with a proximal snapshot (no-grad passes in lockstep), evaluation from its own refilled copy
    env = {**os.environ, "TRUSTBATCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    extra = ["train.strategy=fsdp2", "rollout.precision=bfloat16", "rollout.staleness=1", "train.minibatches=2",
             "objective.name=p3o_two_anchor"]
    records = _torchrun(run, env, *extra)
    assert "heldout_accuracy" in records[2] and records[2]["optimizer_steps"] == 2
    assert (run / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trustbatch", "train", "--resume", str(run), "train.steps=3"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4


def test_ray_learners_refuse_fsdp2():
    from trustbatch.config import load_config
    from trustbatch.errors import UserError
    from trustbatch.recipes.build import check_orchestrator

    with pytest.raises(UserError, match="train.strategy=fsdp2 runs under torchrun"):
        check_orchestrator(load_config(None, ["orchestrator=ray", "rollout.mode=async", "train.strategy=fsdp2"]))
