"""LoRA under FSDP2 through the real command: ``torchrun --nproc-per-node 2 -m trustbatch train model.lora.r=4
train.strategy=fsdp2`` (gloo, CPU) for 4 rounds of the tiny job equals the same LoRA run with ``train.strategy=ddp``
on 2 ranks, a run stopped at round 2 and resumed to round 4 equals the uninterrupted one bit for bit, and
``trustbatch export`` of its checkpoint holds ``W + (α/r)·B·A`` computed here from the checkpoint's adapter and the
base's tensors.

The DDP comparison: the rollouts are the same every round (the fields only they determine, the sampled text, rewards
and held-out numbers: the engine and the evaluation received the merged weights), the losses, gradient norms, ESS and
entropies agree to float32 round-off, and the saved adapters (peft's files, whole tensors) and Adam moments agree
within 1e-3 of their update in L2 (test_fsdp2_end_to_end's bound; measured here: adapters ≤ 2.3e-6, moments
≤ 5.2e-6). The reward
(``even_length``, with spread under the tiny policy) and lr 1e-2 with two optimizer steps a round keep every round's
gradient away from 0 (the task's own reward is 0 after round 1), so rounds 2-4 check the merged weights each update
pushes, and ``A`` trains too (its gradient is 0 while ``B`` is).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lora_merge import merged_by_hand
from runproc import ROOT, cache, records  # noqa: F401
from tiny import TINY

ALPHA, R = 8, 4
LORA = TINY + ["train.steps=4", "checkpoint_every=1", "checkpoint_keep=5", "threads=1", f"model.lora.r={R}",
               f"model.lora.alpha={ALPHA}", "train.lr=1e-2", "train.minibatches=2",
               "reward.name=scorers_for_tests:even_length", "reward.workers=0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ROLLOUT_FIELDS = ("num_tokens", "response_length", "truncated_fraction", "reward_mean", "reward_std")
ADAPTER = "adapter_model.safetensors"
UPDATE_L2_TOL = 1e-3


def _run(args: list[str], timeout: float = 300) -> None:
    support = str(ROOT / "tests" / "support")  # scorers_for_tests, imported by the ranks
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (support, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]


def _train(run, strategy: str, *extra: str) -> list[str]:
    return [*TORCHRUN, "-m", "trustbatch", "train", *LORA, f"train.strategy={strategy}", f"run_dir={run}", *extra]


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("fsdp2_lora")
    _run(_train(d / "fsdp2", "fsdp2"))
    return d


def _adapter(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / ADAPTER))


def _samples(run) -> list[dict]:
    # the behaviour log-prob sums carry the weights' round-off; the text, rewards and references must be equal
    return [{k: v for k, v in json.loads(x).items() if k != "behaviour_logprob_sum"}
            for x in (run / "samples.jsonl").read_text().splitlines()]


def _off(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """How far ``got`` is from ``want``, in L2, as a fraction of ``want``'s update from ``start``."""
    update = (want.double() - start.double()).norm()
    assert update > 0
    return float((got.double() - want.double()).norm() / update)


def test_lora_on_two_fsdp2_ranks_equals_two_ddp_ranks(runs):
    _run(_train(runs / "ddp", "ddp"))
    ddp, fsdp2 = records(runs / "ddp"), records(runs / "fsdp2")
    assert [r["step"] for r in fsdp2] == [r["step"] for r in ddp] == [0, 1, 2, 3, 4]
    for a, b in zip(ddp[1:], fsdp2[1:]):
        assert {k: b[k] for k in ROLLOUT_FIELDS} == {k: a[k] for k in ROLLOUT_FIELDS}, a["step"]
        assert a["grad_norm"] > 1e-2 and a["reward_std"] > 0, a["step"]  # every round trains
        for key in ("loss", "grad_norm", "entropy"):  # measured: ≤ 5e-6 (the loss), ≤ 1.4e-6 (the others)
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
        # ESS ≈ 1: its distance to 1 (measured: ≤ 3e-5 relative)
        assert 1 - b["ess"] == pytest.approx(1 - a["ess"], rel=1e-3), a["step"]
        held = [k for k in a if k.startswith("heldout_")]
        assert {k: b.get(k) for k in held} == {k: a[k] for k in held}, a["step"]
    assert _samples(runs / "fsdp2") == _samples(runs / "ddp")
    # the checkpoint is a DDP run's: peft's files, its config, whole tensors under the same names
    ckpt = {r: runs / r / "checkpoints" / "step_000004" for r in ("ddp", "fsdp2")}
    assert sorted(p.name for p in ckpt["fsdp2"].iterdir()) == sorted(p.name for p in ckpt["ddp"].iterdir())
    assert not (ckpt["fsdp2"] / "model.safetensors").exists()
    config = [json.loads((c / "adapter_config.json").read_text()) for c in ckpt.values()]
    for c in config:  # peft writes the set of adapted module names in the order of the process's string hashes
        c["target_modules"] = sorted(c["target_modules"])
    assert config[0] == config[1]  # e.g. auto_mapping's class: the model's, not FSDP2's FSDPLlamaForCausalLM
    start, want, got = _adapter(runs / "ddp", 0), _adapter(runs / "ddp", 4), _adapter(runs / "fsdp2", 4)
    assert sorted(got) == sorted(want) == sorted(start) and len(want) == 14  # A and B of 7 linear layers
    assert all(not t.any() for k, t in start.items() if ".lora_B." in k)  # peft's B = 0: the update is the run's
    for k in want:
        assert got[k].shape == want[k].shape, k
        off = _off(got[k], want[k], start[k])
        assert off <= UPDATE_L2_TOL, f"{k}: 2 FSDP2 ranks off 2 DDP ranks by {off:.3g} of the update (L2)"
    from trustbatch.trainer.checkpoint import load_trainer_state

    opt = {r: load_trainer_state(c)["learner"]["optimizer"] for r, c in ckpt.items()}
    assert opt["fsdp2"]["param_groups"] == opt["ddp"]["param_groups"]
    assert sorted(opt["fsdp2"]["state"]) == sorted(opt["ddp"]["state"]) == list(range(14))
    for i, moments in opt["ddp"]["state"].items():
        got_m = opt["fsdp2"]["state"][i]
        assert torch.equal(got_m["step"], moments["step"]) and float(moments["step"]) == 8  # 2 steps x 4 rounds
        for k in ("exp_avg", "exp_avg_sq"):
            assert _off(got_m[k], moments[k], torch.zeros_like(moments[k])) <= UPDATE_L2_TOL, (i, k)


# slow (make test-slow; 19 s of launches): FSDP2's resume is the default suite's in test_fsdp2_end_to_end.py and a
# LoRA run's in tests/unit/test_lora.py; this is their combination
@pytest.mark.slow
def test_a_lora_fsdp2_run_stopped_at_round_2_and_resumed_equals_the_uninterrupted_run(runs):
    run = runs / "resumed"
    _run(_train(run, "fsdp2", "train.steps=2"))
    _run([*TORCHRUN, "-m", "trustbatch", "train", "--resume", str(run), "train.steps=4"])
    ref = runs / "fsdp2"
    for step in (3, 4):
        want, got = _adapter(ref, step), _adapter(run, step)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), step
    assert records(run) == records(ref)
    from trustbatch.trainer.checkpoint import load_trainer_state

    want, got = (load_trainer_state(r / "checkpoints" / "step_000004")["learner"]["optimizer"] for r in (ref, run))
    assert got["param_groups"] == want["param_groups"]
    for i, moments in want["state"].items():
        for k, v in moments.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


def test_export_of_a_lora_fsdp2_run_holds_the_merged_weights(runs, tmp_path):
    out = tmp_path / "export"
    _run([sys.executable, "-m", "trustbatch", "export", str(runs / "fsdp2"), "--out", str(out)])
    ckpt = runs / "fsdp2" / "checkpoints" / "step_000004"
    base = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    w0, adapter = load_file(os.path.join(base, "model.safetensors")), load_file(str(ckpt / ADAPTER))
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(w0)
    expected = merged_by_hand(w0, adapter, ALPHA / R)
    assert len([k for k in w0 if not torch.equal(expected[k], w0[k])]) == 7  # every adapted layer moved
    for k in w0:
        torch.testing.assert_close(exported[k], expected[k], rtol=0, atol=1e-6)
