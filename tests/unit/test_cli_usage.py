"""Click's own usage errors (an unknown command or option, an option without its value, a missing argument) end as
every other bad input does: one line on stderr, ``trustbatch: error: ...``, exit code 2, naming the command whose
``--help`` to read. typer printed them as a boxed panel of 3-6 lines."""

import sys

import pytest

from trustbatch.cli import main


def _run(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["trustbatch", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("argv,says", [
    (["evall"], ["No such command 'evall'", "trustbatch --help)"]),
    (["--bogus"], ["No such option", "--bogus", "trustbatch --help)"]),
    (["eval", "--model"], ["Option '--model' requires an argument", "trustbatch eval --help)"]),
    (["eval", "--model", "m", "-b", "gsm8k", "--samples", "3"],
     ["No such option", "--samples", "trustbatch eval --help"]),
    (["train", "--config"], ["Option '--config' requires an argument", "trustbatch train --help)"]),
    (["report"], ["Missing argument", "runs", "trustbatch report --help)"]),
    (["lab", "nothing"], ["No such command 'nothing'", "trustbatch lab --help)"]),
    (["lab", "run", "--jobs"], ["Option '--jobs' requires an argument", "trustbatch lab run --help)"]),
    (["lab", "run", "clip", "--jobs", "x"], ["Invalid value for '--jobs'", "trustbatch lab run --help)"]),
])
def test_a_usage_error_is_one_line_and_exit_2(monkeypatch, capsys, argv, says):
    code, _, err = _run(monkeypatch, capsys, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("trustbatch: error: "), err
    # fragments, lowercase: typer 0.20's click words them otherwise ("No such option '--bogus'.", 'RUNS...')
    for s in says:
        assert s.lower() in lines[0].lower(), (s, lines[0])


@pytest.mark.parametrize("argv", [[], ["lab"], ["--help"], ["lab", "run", "--help"]])
def test_no_arguments_and_help_still_print_the_help(monkeypatch, capsys, argv):
    code, out, err = _run(monkeypatch, capsys, argv)
    assert "Usage: " in out + err and "trustbatch: error" not in out + err


@pytest.mark.parametrize("argv,says", [
    (["train", "num_generations=8"], "unknown config key 'num_generations'; TRL's num_generations is rollout.group_size"),
    (["train", "train.learning_rate=1e-6"], "TRL's learning_rate is train.lr here"),
    (["train", "top_k=50"], "TRL's top_k has no equivalent here: sampling takes rollout.temperature and rollout.top_p"),
    (["train", "--repetition_penalty", "1.1"], "TRL's repetition_penalty has no equivalent here"),
    (["train", "--max_completion_length", "256"], "--max_completion_length (TRL's max_completion_length is "
                                                  "rollout.max_new_tokens here) is not an option"),
])
def test_trls_argument_names_say_what_sets_the_same_here(monkeypatch, capsys, argv, says):
    code, _, err = _run(monkeypatch, capsys, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0], err


def test_every_key_a_trl_name_points_to_exists():
    """Each dotted key in ``TRL_NAMES``' answers is a config key, and each option named in ``objective.options={...}``
    one the objectives take (TRL's own field names are checked against GRPOConfig in tests/unit/test_adapters_trl.py)."""
    import re

    from trustbatch.config.load import TRL_NAMES, TRL_UNSUPPORTED, config_fields
    from trustbatch.objectives.registry import COMMON_OPTIONS
    from trustbatch.objectives.clipped import _PPO_OPTIONS

    keys = {k for k, _, _ in config_fields()}
    for trl, ours in {**TRL_NAMES, **TRL_UNSUPPORTED}.items():
        named = re.findall(r"\b(?:[a-z_]+\.)+[a-z_]+\b|\brun_dir\b|\bcheckpoint_(?:every|keep)\b", ours)
        assert named and all(k in keys for k in named), (trl, ours)
        for option in re.findall(r"([a-z_]+): \.\.\.", ours.partition("={")[2]) if "options=" in ours else []:
            assert option in {**COMMON_OPTIONS, **_PPO_OPTIONS}, (trl, option)
