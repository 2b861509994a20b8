"""A lab run's config file keeps the defaults that follow the data: the runner writes every key to ``seedN.yaml``
and trains with ``--config``, so a GSM8K arm's ``rollout.max_new_tokens`` read as set at its default of 8 (every
answer cut) where ``trustbatch train data=gsm8k`` gets GSM8K's budget. The reference: the budget rule by hand, 512
tokens capped at half the model's 512-token context."""

import yaml

from trustbatch.config import load_config
from trustbatch.lab.experiment import Experiment
from trustbatch.lab.runner import _command


def test_a_data_file_arm_gets_the_answer_budget_and_a_set_budget_stays(tmp_path, shared_dir):
    data, model = shared_dir / "data" / "gsm8k" / "train.jsonl", shared_dir / "models" / "stories260K-hf"
    common = {"data.train": str(data), "model.path": str(model)}
    exp = Experiment(name="x", description="", seeds=[0],
                     arms={"auto": dict(common), "set": {**common, "rollout.max_new_tokens": 12}})
    for arm, want in (("auto", min(512, 512 // 2)), ("set", 12)):
        cmd = _command(exp, arm, 0, tmp_path / arm / "seed0")
        written = tmp_path / arm / "seed0.yaml"
        assert cmd == ["train", "--config", str(written)]
        assert yaml.safe_load(written.read_text())["rollout"]["max_new_tokens"] == want, arm
        assert load_config(str(written)).rollout.max_new_tokens == want


def test_the_preflight_probes_a_data_file_arm_at_its_runs_budget(tmp_path, shared_dir, monkeypatch):
    """The pre-flight measures a step the arm's run really takes: it probed a GSM8K arm at 8 new tokens while the run
    trains at 256 (the reviewer's: response_length 8.0)."""
    import pytest

    import trustbatch.lab.preflight as preflight
    from trustbatch.errors import UserError

    data, model = shared_dir / "data" / "gsm8k" / "train.jsonl", shared_dir / "models" / "stories260K-hf"
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"description": "", "seeds": [0], "arms": {
        "auto": {"data.train": str(data), "model.path": str(model)}}}))
    seen = []

    def probe(cfg, arm, console=None):
        seen.append(cfg.rollout.max_new_tokens)
        raise UserError("not probed here")

    monkeypatch.setattr(preflight, "probe_arm", probe)
    with pytest.raises(UserError, match="no arm could be measured"):
        preflight.run_preflight(str(tmp_path / "x.yaml"), tmp_path / "out")
    assert seen == [256]
