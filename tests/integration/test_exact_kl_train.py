"""``trustbatch train`` with kl="exact": the source hands the learner each row's behaviour model, end to end.

One round of the tiny job, half of each group sampled by a foreign model. With the foreign model "initial" (the frozen
starting checkpoint, which is the policy in round 1) every behaviour is the policy, so the rebuilt KL(π_θ‖π_b) is 0
up to float32 round-off. With a foreign model of another width and seed it is positive: a learner that took the
foreign rows' behaviour from the policy would report 0 there too, one that dropped them would fail.

At a rollout precision other than float32 (fp8_e4m3, bfloat16) the engine records the distribution it sampled
from and the learner takes the KL against that record: the run's kl_behavior equals a float64 brute force over the
recorded distributions of the batch the learner received, whose values at the sampled tokens are the batch's
behaviour log-probs bit for bit. (The same runs' kl_behavior, loss and grad_norm equal, bit for bit, those of
commit c921d82, which stored the recorded [B, C, V] tensor: checked by hand, not here.) A run whose record would
pass the memory budget is refused in one line before any rollout.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train
from trustbatch.recipes.checks import check_recorded_behaviour
from trustbatch.trainer.learner import Learner

from tiny import TINY


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))


def _round_one_kl(run, foreign: str) -> float:
    train(load_config(None, TINY + ["train.steps=1", f"run_dir={run}", "objective.options={kl: exact}",
                                    "rollout.foreign_fraction=0.5", f"rollout.foreign_model={foreign}",
                                    "eval.every=100", "checkpoint_every=100"]))
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[1])["kl_behavior"]


def test_exact_kl_run_rebuilds_each_rows_behaviour(tmp_path, cache):
    assert abs(_round_one_kl(tmp_path / "same", "initial")) < 1e-6
    assert _round_one_kl(tmp_path / "other", "{hidden: 48, layers: 1, seed: 1}") > 1e-3


def _kl_float64(model, batch) -> float:
    """Token mean over the batch of Σ_v p_θ(v)·(log p_θ(v) − log π_recorded(v)), in float64 from a float64 copy
    of the policy the learner starts the step with (the learner stays at T = 1). Foreign rows (version < 0) add 0:
    their behaviour is the initial model, which is the policy in round 1."""
    pk, C = batch.packed, batch.packed.response_mask.shape[1]
    m64 = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = m64(input_ids=pk.input_ids, attention_mask=pk.attention_mask, position_ids=pk.position_ids).logits
    lsm = torch.log_softmax(logits[:, -C - 1:-1].double(), -1)
    kl = (lsm.exp() * (lsm - batch.behavior_logprobs_full.double())).sum(-1)
    mask = pk.response_mask.bool()
    return float(kl[mask & (batch.policy_version >= 0)[:, None]].sum() / mask.sum())


@pytest.mark.parametrize("precision, extra", [
    ("fp8_e4m3", []), ("bfloat16", []),
    # half of each group from the float32 initial model (rebuilt, KL 0), the rest recorded; row blocks of 2 rows
    ("fp8_e4m3", ["rollout.foreign_fraction=0.5", "rollout.foreign_model=initial", "train.micro_batch_size=3",
                  "train.logprob_chunk_size=2"]),
], ids=["fp8", "bf16", "fp8-foreign-row-blocks"])
def test_exact_kl_run_takes_the_recorded_distribution_off_float32(tmp_path, cache, monkeypatch, precision, extra):
    seen = []
    original = Learner.train_on

    def spy(self, batch, **kw):
        if not seen:  # round 1: the policy before its first update, and the batch as the source built it
            seen.append((copy.deepcopy(self.model), batch))
        return original(self, batch, **kw)

    monkeypatch.setattr(Learner, "train_on", spy)
    run = tmp_path / precision
    train(load_config(None, TINY + ["train.steps=1", f"run_dir={run}", "objective.options={kl: exact}",
                                    f"rollout.precision={precision}", "eval.every=100", "checkpoint_every=100",
                                    *extra]))
    got = json.loads((run / "metrics.jsonl").read_text().splitlines()[1])["kl_behavior"]
    model, batch = seen[0]
    full, m = batch.behavior_logprobs_full, batch.packed.response_mask.bool()
    assert full is not None and full.dtype == torch.float32
    tokens = batch.packed.input_ids[:, -m.shape[1]:]
    at_tokens = full.gather(-1, tokens[..., None]).squeeze(-1)
    own = m & (batch.policy_version >= 0)[:, None]
    assert own.any() and torch.equal(at_tokens[own], batch.behavior_logprobs[own])  # what the tokens were sampled from
    want = _kl_float64(model, batch)
    # float32 learner against float64: ~1e-7 per token; the teacher-forced rebuild at fp8_e4m3 reports 2.7e-5 where
    # the record gives 2.2e-5 (a 5e-6 gap), so the tolerance tells them apart
    assert want > 1e-7 and abs(got - want) < 2e-7 + 1e-3 * want, (got, want)


ROUND = ["rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.max_new_tokens=8"]  # 4,096 tokens


def test_recorded_distribution_over_the_budget_is_refused_in_one_line():
    cfg = load_config(None, ["objective.options={kl: exact}", "rollout.precision=fp8_e4m3", *ROUND])
    check_recorded_behaviour(cfg, vocab=304)  # the lab's V: 4,096 tokens x 304 x 4 bytes = 5 MiB
    with pytest.raises(UserError) as e:
        check_recorded_behaviour(cfg, vocab=151_936)  # 4,096 x 151,936 x 4 bytes = 2,374 MiB > 256 MiB
    msg = str(e.value)
    assert "\n" not in msg and "rollout.precision=fp8_e4m3" in msg and "2374 MiB" in msg and "256 MiB" in msg
    assert "rollout.precision=float32" in msg and "kl='k3'" in msg
    for ok in (["rollout.precision=float32"], ["objective.options={kl: k3}"]):  # rebuilt, or no whole distribution
        check_recorded_behaviour(load_config(None, ["objective.options={kl: exact}", *ROUND, *ok]), vocab=151_936)
    # the record is held twice at its peak (the rows beside the batch; the batch beside a mini-batch's copy): 216
    # tokens x 151,936 x 4 bytes = 125 MiB fit, 232 tokens = 134.5 MiB (269 MiB held) do not
    for prompts, fits in ((27, True), (29, False)):
        small = load_config(None, ["objective.options={kl: exact}", "rollout.precision=fp8_e4m3",
                                   f"rollout.prompts_per_step={prompts}", "rollout.group_size=8",
                                   "rollout.max_new_tokens=1"])
        if fits:
            check_recorded_behaviour(small, vocab=151_936)
        else:
            with pytest.raises(UserError, match="held twice at its peak"):
                check_recorded_behaviour(small, vocab=151_936)
    # packed, or with foreign rows, the learner copies it once more (a reviewer's peaks for a 1,187 MiB record:
    # 2,025 MiB padded, 3,259 packed, 2,975 with a quarter foreign rows): 144 tokens x 3 = 250 MiB fit, 152 do not
    for extra in (["train.padding_free=true"], ["rollout.foreign_fraction=0.5"]):
        for prompts, fits in ((18, True), (19, False)):
            small = load_config(None, ["objective.options={kl: exact}", "rollout.precision=fp8_e4m3",
                                       f"rollout.prompts_per_step={prompts}", "rollout.group_size=8",
                                       "rollout.max_new_tokens=1", *extra])
            if fits:
                check_recorded_behaviour(small, vocab=151_936)
            else:
                with pytest.raises(UserError, match="held three times at its peak"):
                    check_recorded_behaviour(small, vocab=151_936)


def test_cli_refuses_a_recorded_distribution_over_the_budget(tmp_path):
    """``trustbatch train`` exits 2 with the one line, before any rollout: 4,096 prompts x 4 samples x 16 steps at
    the tiny job's V (304) is 304 MiB, over 256 MiB. (Building the base first writes progress bars to stderr.)"""
    env = dict(os.environ, TRUSTBATCH_CACHE=str(tmp_path / "cache"))
    args = [a for a in TINY if not a.startswith(("rollout.prompts_per_step", "rollout.max_new_tokens"))]
    p = subprocess.run([sys.executable, "-m", "trustbatch", "train", *args, f"run_dir={tmp_path / 'run'}",
                        "objective.options={kl: exact}", "rollout.precision=bfloat16",
                        "rollout.prompts_per_step=4096", "rollout.max_new_tokens=16"],
                       capture_output=True, text=True, env=env, timeout=600)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("trustbatch: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
    assert "rollout.precision=bfloat16 needs the behaviour" in errors[0] and "304 MiB" in errors[0], errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any round
