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
