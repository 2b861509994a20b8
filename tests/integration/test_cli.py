"""Bad input ends with one line on stderr naming the cause, and exit code 2; a raising scorer gives reward 0."""

import subprocess
import sys

import pytest

from trustbatch import rewards
from trustbatch.config import load_config
from trustbatch.errors import UserError


def run_cli(*args, env_extra=None, tmp_path=None):
    import os

    env = dict(os.environ)
    if tmp_path is not None:
        env["TRUSTBATCH_CACHE"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "trustbatch", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["train", "train.stepz=3"], "unknown config key 'train.stepz'"),
    (["train", "train.lr=-1"], "invalid value for 'train.lr'"),
    (["train", "objective.name=ppo2"], "unknown objective 'ppo2'"),
    (["train", "task.name=no_such_task", "run_dir=RUN"], "unknown task 'no_such_task'"),
    (["train", "model.path=/nonexistent/model", "run_dir=RUN"], "model path '/nonexistent/model' does not exist"),
    (["train", "objective.options={epsilon: 0.2}", "run_dir=RUN"], "unknown option 'epsilon'"),
    (["train", "task.heldout_size=5000", "run_dir=RUN"], "distinct prompts"),
    (["train", "--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml' does not exist"),
    (["train", "--resume", "/nonexistent_run"], "cannot resume"),
    # an option the command lacks (TRL's habit: --max_steps) names the key or option meant, not a usage box
    (["train", "--steps", "2"], "--steps (did you mean train.steps=...?) is not an option of this command"),
    (["train", "--resum", "x"], "--resum (did you mean --resume?) is not an option"),
    (["sft", "--ot", "x"], "--ot (did you mean --out?) is not an option of this command (its options: --config, --out)"),
])
def test_bad_input_one_line_exit_2(args, message, tmp_path, monkeypatch, capsys):
    """In this process (``runproc.main_in_process``); the two cases below as real commands."""
    from runproc import main_in_process

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    code, _, err = main_in_process(monkeypatch, capsys, *(a.replace("RUN", str(tmp_path / "run")) for a in args))
    assert code == 2, err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert message in lines[0]
    assert lines[0].startswith("trustbatch: error:")


@pytest.mark.parametrize("args, message", [
    (["train", "train.stepz=3"], "unknown config key 'train.stepz'"),
    (["train", "model.path=/nonexistent/model", "run_dir=RUN"], "model path '/nonexistent/model' does not exist"),
])
def test_bad_input_one_line_exit_2_from_the_command(args, message, tmp_path):
    args = [a.replace("RUN", str(tmp_path / "run")) for a in args]
    p = run_cli(*args, tmp_path=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr
    assert message in lines[0]
    assert lines[0].startswith("trustbatch: error:")


def test_overrides_parse_as_yaml():
    cfg = load_config(None, ["train.steps=7", "objective.name=grpo", "objective.options={eps_high: 0.28}", "task.params.max_terms=4"])
    assert cfg.train.steps == 7 and cfg.objective.name == "grpo" and cfg.objective.options == {"eps_high": 0.28}
    assert cfg.task.params["max_terms"] == 4 and cfg.task.params["min_terms"] == 2
    with pytest.raises(UserError, match="key=value"):
        load_config(None, ["train.steps"])


def test_raising_scorer_gives_zero_and_is_counted():
    def scorer(c, r):
        if c == "boom":
            raise RuntimeError("scorer bug")
        return float("nan") if c == "nan" else 1.0

    out, errors = rewards.score_all(scorer, ["ok", "boom", "nan", "ok"], ["", "", "", ""])
    assert out == [1.0, 0.0, 0.0, 1.0] and errors == 2


def test_reasoning_gym_scorer():
    import json

    s = rewards.get("rg:chain_sum")
    ref = json.dumps({"answer": "-4", "metadata": {}})
    assert s(" -4", ref) == 1.0 and s(" 4", ref) == 0.0


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_second_config_file_is_refused_not_layered_in_silence(tmp_path, command):
    """`--config a.yaml --config b.yaml` kept b.yaml alone: a.yaml's train.steps=3 was lost without a word."""
    from typer.testing import CliRunner

    from trustbatch.cli import app

    (tmp_path / "a.yaml").write_text("train:\n  steps: 3\n")
    (tmp_path / "b.yaml").write_text("train:\n  lr: 0.01\n")
    done = CliRunner().invoke(app, [command, "-c", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.yaml"),
                                    *(["--print-config"] if command == "train" else [])])
    assert isinstance(done.exception, UserError) and str(done.exception).startswith("--config is given 2 times")
    one = CliRunner().invoke(app, ["train", "-c", str(tmp_path / "a.yaml"), "--print-config"])
    assert one.exit_code == 0 and "steps: 3" in one.output
