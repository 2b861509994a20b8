"""What the config alone refuses is refused before any model is built: the async pipeline's refusals of the simulated
lag and of foreign rows, and LoRA with Ray learner actors, ran after the base was built (600 SFT steps at the default
sizes) or a ``model.path`` loaded. Through ``recipes.train``, a fresh cache: it stays empty."""

import pytest

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train

from tiny import TINY


@pytest.mark.parametrize("extra,says", [
    (["rollout.mode=async", "rollout.staleness=1"], "rollout.mode=async does not run with rollout.staleness"),
    (["rollout.mode=async", "rollout.foreign_fraction=0.25", "objective.name=grpo"],
     "rollout.mode=async does not run with rollout.foreign_fraction"),
    (["rollout.mode=async", "orchestrator=ray", "ray_learners=1", "model.lora={r: 4, alpha: 8}"],
     "model.lora does not run with Ray learner actors"),
])
def test_a_config_only_refusal_comes_before_any_model(tmp_path, monkeypatch, extra, says):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=says):
        train(load_config(None, TINY + extra + [f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert not (tmp_path / "run").exists()
