"""``trustbatch train`` with a reference KL (objective.options ref_kl_coef) and an entropy bonus, end to end.

A real run logs ``kl_ref`` (the objective's k3 against the frozen reference, token mean) every round: 0 in round 1,
where the policy is the initial policy, which is the default reference (its one optimizer step runs before the
update); finite and positive afterwards (the entropy bonus moves the policy even in a round whose rewards are all
equal). A resume keeps the initial policy as the reference, not the checkpoint it restores: the resumed round
equals the uninterrupted run's. ``model.reference`` loads another directory of the policy's tokenizer (here a later
checkpoint of that run, so the KL is positive from round 1). Under FSDP2 the reference is sharded as the policy:
two gloo ranks give the one-process gradient of the whole batch.
"""

import math
import subprocess
from pathlib import Path

import pytest
import torch

from trustbatch.trainer.learner import Learner

from runproc import ROOT, cache, records, resume_args, train_args  # noqa: F401  (fixture)
from gloo_ranks import two_gloo_ranks
from test_parallel import _batch, _close

REF_KL = ["objective.options={ref_kl_coef: 0.04, entropy_coef: 0.01}", "train.lr=1e-2", "eval.every=100"]


def _train(run: Path, *extra: str) -> list[dict]:
    done = subprocess.run(train_args(run, *REF_KL, *extra), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in records(run) if r.get("step", 0) > 0]


@pytest.fixture(scope="module")
def three_rounds(cache, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("refkl") / "run"
    return run, _train(run, "train.steps=3")


def test_the_reference_kl_is_logged_every_round_and_zero_before_the_first_update(three_rounds):
    _, rounds = three_rounds
    kl = [r["kl_ref"] for r in rounds]
    assert len(kl) == 3 and all(math.isfinite(x) and x >= 0 for x in kl), kl
    assert kl[0] < 1e-9, kl  # round 1: π_θ = π_ref at its one optimizer step (0 up to float32 round-off)
    assert kl[1] > 1e-6 and kl[2] > 1e-6, kl  # the updates moved the policy away from the initial one
    assert all(math.isfinite(r["entropy"]) and r["entropy"] > 0 for r in rounds)


@pytest.mark.slow
def test_a_resume_keeps_the_initial_policy_as_the_reference(three_rounds, tmp_path):
    run, uninterrupted = three_rounds
    _train(tmp_path / "run", "train.steps=2")
    again = subprocess.run(resume_args(tmp_path / "run", "train.steps=3"), cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [r for r in records(tmp_path / "run") if r.get("step", 0) > 0]
    assert resumed[2] == uninterrupted[2]  # a reference taken from the checkpoint would give a KL near 0 there


def test_model_reference_is_another_directory_of_the_policys_tokenizer(three_rounds, tmp_path):
    run, _ = three_rounds
    later = run / "checkpoints" / "step_000003"
    assert (later / "config.json").exists()
    rounds = _train(tmp_path / "run", "train.steps=1", f"model.reference={later}")
    assert rounds[0]["kl_ref"] > 1e-6  # round 1: the initial policy against the trained one
    assert f"reference: {later}" in (tmp_path / "run" / "config.yaml").read_text()  # the run's config names it


# ---- FSDP2: the reference sharded as the policy ------------------------------------------------------------


def _model(seed=0, noise=0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(world, strategy="fsdp2", micro_batch_size=2) -> dict:
    """One step's whole gradients of GRPO with a reference KL against a perturbed copy of the initial weights, on
    5 rows in micro-batches of 2: rank 0 runs two micro-batches and rank 1 one plus an empty one, so rank 1's
    reference pass runs an empty forward of the sharded reference too."""
    from grad_probe import sgd_recording_grads

    model = _model()
    learner = Learner(model, "grpo", {"ref_kl_coef": 0.5}, lr=1e-2, grad_clip=1e9, micro_batch_size=micro_batch_size,
                      world=world, strategy=strategy, reference=_model(noise=0.2))
    grads = sgd_recording_grads(learner, model)
    batch = _batch(5)
    if world is not None and world.size > 1:
        batch = batch.select(world.shard(len(batch)))
    metrics = learner.step(batch)
    return {"grads": {n: _whole(g) for n, g in grads.items()}, "kl_ref": metrics["kl_ref"],
            "sharded": learner.sharded and type(learner.reference).__name__.startswith("FSDP")}


def _fsdp2_reference(world, out_dir):
    return _grads(world)


@pytest.mark.slow
def test_under_fsdp2_the_sharded_reference_gives_the_one_process_gradient(tmp_path):
    ranks = two_gloo_ranks(_fsdp2_reference, tmp_path)
    want = _grads(None, "ddp", micro_batch_size=64)
    assert want["kl_ref"] > 1e-3
    assert len(want["grads"]) == len(list(_model().parameters()))  # the optimizer step was recorded
    for rank in range(2):
        got = ranks[rank]
        assert got["sharded"]
        assert got["kl_ref"] == pytest.approx(want["kl_ref"], rel=1e-5)
        for n, g in want["grads"].items():
            _close(got["grads"][n], g, f"grad {n} rank {rank}", tol=1e-5)
