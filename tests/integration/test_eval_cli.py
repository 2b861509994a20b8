"""``trustbatch eval`` end to end on the real stories260K model, and ``trustbatch train data=FILE``."""

import json
import math
import subprocess
import sys

import pytest

from trustbatch.config import load_config
from trustbatch.recipes import train


def _cli(*args, tmp_path):
    import os

    env = dict(os.environ, TRUSTBATCH_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "trustbatch", *args], capture_output=True, text=True, env=env, timeout=600)


def test_eval_story_model_on_gsm8k_reports_pass_at_k_about_zero(tmp_path, shared_dir):
    out = tmp_path / "eval.json"
    p = _cli("eval", "--model", str(shared_dir / "models" / "stories260K-hf"),
             "-b", str(shared_dir / "data" / "gsm8k" / "test.jsonl"), "-b", "countdown",
             "--data-dir", str(shared_dir / "data"), "--limit", "6", "-n", "4", "-k", "1,2,4",
             "--max-new-tokens", "48", "--out", str(out), tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["benchmarks"]) == {"gsm8k", "countdown"}
    for name, row in res["benchmarks"].items():
        assert row["prompts"] == 6 and len(row["correct"]) == 6 and all(0 <= c <= 4 for c in row["correct"])
        for k in (1, 2, 4):
            assert 0.0 <= row[f"pass@{k}"] <= 0.05, (name, k, row[f"pass@{k}"])  # a story model: about 0
            assert row[f"pass@{k}_se"] is not None and row[f"pass@{k}_se"] >= 0
        assert row["reward_errors"] == 0 and row["reward_timeouts"] == 0
    assert set(res["average"]) == {f"pass@{k}{s}" for k in (1, 2, 4) for s in ("", "_se")}
    assert "pass@4" in p.stdout and "average" in p.stdout


def test_eval_warnings_stay_one_line_off_a_terminal(tmp_path, shared_dir):
    """stdout to a pipe: rich would wrap at 80 columns; a warning in a log must stay one line (issue 45 item 9)."""
    rows = [{"question": "How many? " * 300, "answer": "1"}, {"question": "What is 1 + 1?", "answer": "2"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _cli("eval", "--model", str(shared_dir / "models" / "stories260K-hf"), "-b", str(tmp_path / "rows.jsonl"),
             "--prompt-field", "question", "--answer-field", "answer", "--reward", "gsm8k", "-n", "1", "-k", "1",
             "--max-new-tokens", "4", "--workers", "0", "--out", str(tmp_path / "eval.json"), tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # the results name the scorer that scored: --reward's, not the rows' own (math), which they named before
    assert json.loads((tmp_path / "eval.json").read_text())["benchmarks"]["rows"]["reward"] == "gsm8k"
    warned = [line for line in p.stdout.splitlines() if line.startswith("warning: rows: skipped 1 of 2 prompts")]
    assert len(warned) == 1 and len(warned[0]) > 80, p.stdout
    assert warned[0].endswith("lower max_new_tokens to keep them"), p.stdout


@pytest.mark.parametrize("args, message", [
    (["-b", "gsm8k", "-n", "2", "-k", "1,4"], "need 1 <= k <= n"),
    (["-b", "/nonexistent.jsonl"], "neither a file nor a known benchmark"),
    (["-b", "gsm8k", "--reward", "nosuch"], "unknown reward 'nosuch'"),
    (["-b", "gsm8k", "-b", "gsm8k"], "benchmark 'gsm8k' is given twice (-b)"),
])
def test_eval_bad_input_one_line(args, message, tmp_path, shared_dir, monkeypatch, capsys):
    from runproc import main_in_process  # the refusals of a real command: test_a_datasets_that_fails_to_import...

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    code, _, err = main_in_process(monkeypatch, capsys, "eval", "--model", shared_dir / "models" / "stories260K-hf",
                                   "--data-dir", shared_dir / "data", *args)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_train_on_a_gsm8k_file_with_a_hanging_scorer(tmp_path, shared_dir):
    """data=FILE trains from a GSM8K-format file; a scorer that hangs is cut and the run goes on."""
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"data={shared_dir / 'data' / 'gsm8k' / 'train.jsonl'}", "data.train_size=32", "data.heldout_size=4",
        f"model.path={shared_dir / 'models' / 'stories260K-hf'}", "reward.name=scorers_for_tests:hang_on_odd_answer",
        "reward.timeout_s=0.3", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
        "train.steps=2", "eval.every=2", "eval.samples_per_prompt=2", f"run_dir={run}",
        "reward.max_failure_rate=0.9",  # a round may draw three odd answers of four: 75 % of its completions cut
    ])
    assert cfg.data.train.endswith("train.jsonl")
    summary = train(cfg)
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] > 0]
    assert len(steps) == 2 and summary["heldout_prompts"] == 4
    timeouts = sum(r["reward_timeouts"] for r in steps)
    assert timeouts > 0  # every completion for an odd gold answer was cut at 0.3 s
    assert all(math.isfinite(v) for r in recs for v in r.values())


def test_data_shorthand_and_heldout_is_disjoint(shared_dir, tmp_path):
    from trustbatch.recipes import configured_task

    f = tmp_path / "d.jsonl"
    rows = [{"question": f"q{i % 30}", "answer": f"#### {i}"} for i in range(40)]  # 30 distinct prompts
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(None, [f"data={f}", "data.heldout_size=10"])
    task = configured_task(cfg)
    assert task.reward == "gsm8k" and len(task.heldout) == 10 and len(task.train) == 20
    assert not {e.prompt for e in task.heldout} & {e.prompt for e in task.train}


def test_a_datasets_that_fails_to_import_is_one_line_with_its_cause(tmp_path, shared_dir):
    """pyarrow 26 refuses NumPy 1.x at import, and pip does not know: `datasets` is installed but does not import.
    A stand-in package that fails the same way comes first on the path."""
    import os

    fake = tmp_path / "site" / "datasets"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('pyarrow requires NumPy 2.0 or newer, found 1.26.4')\n")
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    env = dict(os.environ, TRUSTBATCH_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "trustbatch", "eval", "--model",
                        str(shared_dir / "models" / "stories260K-hf"), "-b", str(tmp_path / "rows.parquet")],
                       capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "installed but fails to import (pyarrow requires NumPy 2.0 or newer, found 1.26.4)" in lines[0], lines[0]
    assert "pip install 'numpy>=2'" in lines[0] and "or give a JSONL file" in lines[0], lines[0]


@pytest.mark.parametrize("out, message", [("folder", "is a folder, not a file"), ("file/x.json", "which is a file")])
def test_eval_out_is_checked_before_anything_loads(tmp_path, shared_dir, out, message, monkeypatch, capsys):
    """A --out that cannot take the results fails at once, not after the sampling (it was a traceback then): the
    model named does not exist, so a check after loading would have said so instead."""
    from runproc import main_in_process

    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    code, _, err = main_in_process(monkeypatch, capsys, "eval", "--model", tmp_path / "no-model", "--data-dir",
                                   shared_dir / "data", "-b", "gsm8k", "--out", tmp_path / out)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_eval_defaults_fit_the_context_and_results_keep_every_benchmark(tmp_path, shared_dir):
    """Without --max-new-tokens, a model of 512 positions samples 256 new tokens (512 filled its context: an error);
    gsm8k and its own file, both named "gsm8k", are kept apart under the names given."""
    out = tmp_path / "eval.json"
    test_file = str(shared_dir / "data" / "gsm8k" / "test.jsonl")
    p = _cli("eval", "--model", str(shared_dir / "models" / "stories260K-hf"), "--data-dir", str(shared_dir / "data"),
             "-b", "gsm8k", "-b", test_file, "--limit", "1", "-n", "1", "-k", "1", "--workers", "0",
             "--out", str(out), tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["max_new_tokens"] == 256 and sorted(res["benchmarks"]) == sorted(["gsm8k", test_file])


def test_sigterm_ends_eval_as_ctrl_c_does(tmp_path, shared_dir, support_on_pythonpath):
    """Only ``train`` took SIGTERM: ``eval`` (and ``export``, ``sft --out``, which left their staged model folder
    behind) died of its default action, exit -15 and not a word. Now every command ends as on Ctrl-C: exit 130 and
    one line. The scorer (in this process, ``--workers 0``) hangs once it is called, so the signal arrives inside
    the evaluation."""
    import os
    import signal
    import time

    data = tmp_path / "b.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(1, 4)))
    marker = tmp_path / "hang"
    marker.write_text("")
    env = {**os.environ, "TRUSTBATCH_TEST_HANG_MARKER": str(marker), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "trustbatch", "eval", "--model",
                          str(shared_dir / "models" / "stories260K-hf"), "-b", str(data), "-n", "1", "-k", "1",
                          "--max-new-tokens", "4", "--reward", "scorers_for_tests:hang_once", "--workers", "0",
                          "--out", str(tmp_path / "eval.json")], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("hang.*")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp_path.glob("hang.*")), "the scorer was never called"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert lines[-1].startswith("trustbatch: ") and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "eval.json").exists()
