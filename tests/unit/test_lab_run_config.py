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
