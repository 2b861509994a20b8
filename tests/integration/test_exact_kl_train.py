"""``trustbatch train`` with kl="exact": the source hands the learner each row's behaviour model, end to end.

One round of the tiny job, half of each group sampled by a foreign model. With the foreign model "initial" (the frozen
starting checkpoint, which is the policy in round 1) every behaviour is the policy, so the rebuilt KL(π_θ‖π_b) is 0
up to float32 round-off. With a foreign model of another width and seed it is positive: a learner that took the
foreign rows' behaviour from the policy would report 0 there too, one that dropped them would fail.
"""

import json

import pytest

from trustbatch.config import load_config
from trustbatch.recipes import train

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
