"""Issue 37 (item 7): a first run that explains itself. A fresh cache starts from the shipped base without building;
a build says why and shows its SFT steps; an interrupt before the first checkpoint leaves a directory that starts
again; each evaluation writes sample completions."""

import hashlib
import signal
import subprocess
import sys

import pytest

from trustbatch.config import load_config
from trustbatch.policy import base as base_mod
from trustbatch.recipes import configured_task, prepare_run, task_key

from runproc import ROOT, cache, one_line, run, signal_and_wait, start, train_args, wait_until  # noqa: F401
from shipped import default_key, shipped
from tiny import TINY


def test_an_empty_cache_loads_the_shipped_base_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))

    def no_build(*a, **k):
        raise AssertionError("the base was built (an SFT step ran)")

    monkeypatch.setattr(base_mod, "sft", no_build)
    monkeypatch.setattr("trustbatch.recipes.base.build_base", no_build)
    cfg = load_config(None, ["reward.workers=0"])
    _, policy, pool, source = prepare_run(cfg)
    pool.close()
    key, _, _ = default_key()
    copy = tmp_path / "cache" / "base" / f"chain_sum-{key}"
    assert source == f"{copy} (shipped)"
    folder, manifest = shipped()
    assert hashlib.sha256((copy / "model.safetensors").read_bytes()).hexdigest() == manifest["sha256"]["model.safetensors"]
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    loaded = dict(policy.model.state_dict())
    assert all(k in loaded and bool((loaded[k] == v).all()) for k, v in weights.items())
    # the second start finds the cache's copy
    assert base_mod.find_base("chain_sum", task_key(cfg), cfg.model.model_dump(mode="json")) == (copy, "cached")


def test_a_smaller_heldout_set_starts_from_the_shipped_base(tmp_path, monkeypatch):
    """Issue 45 item 8: task.heldout_size=32 is held out of the shipped base's SFT already (it skipped the first 256
    prompts), so it loads that base instead of building one."""
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))

    def no_build(*a, **k):
        raise AssertionError("the base was built (an SFT step ran)")

    monkeypatch.setattr(base_mod, "sft", no_build)
    cfg = load_config(None, ["reward.workers=0", "task.heldout_size=32"])
    task, _, pool, source = prepare_run(cfg)
    pool.close()
    key, _, _ = default_key()
    assert source == f"{tmp_path / 'cache' / 'base' / f'chain_sum-{key}'} (shipped)" and len(task.heldout) == 32


def test_sft_building_and_saving_a_base_prints_no_progress_bar(tmp_path):
    """``trustbatch sft --out DIR`` with an empty cache: the base it builds and the copy it saves to DIR are written
    without transformers' "Writing model shards" bar on stderr (one for each save before)."""
    import os

    done = subprocess.run([sys.executable, "-m", "trustbatch", "sft", *TINY, "model.sft_steps=2", "--out",
                           str(tmp_path / "sft")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRUSTBATCH_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "default base (built now)" in done.stdout and "saved to" in done.stdout  # both saves ran
    assert (tmp_path / "sft" / "model.safetensors").is_file()
    assert "Writing model shards" not in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "sft"]  # written beside it, then renamed


@pytest.mark.parametrize("out, message", [("a_file", "is a file, not a folder"),
                                          ("a_run", "exists and is not an empty directory")])
def test_sft_out_is_checked_before_the_sft(tmp_path, out, message, monkeypatch, capsys):
    """``--out`` naming a file, or a folder with files in it (a run directory), is refused in one line before any
    base is built or trained; before, the SFT ran and its save failed (or wrote into the folder)."""
    import os

    from runproc import main_in_process

    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_run").mkdir()
    (tmp_path / "a_run" / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    code, _, err = main_in_process(monkeypatch, capsys, "sft", *TINY, "--out", tmp_path / out)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err[-3000:]
    assert not (tmp_path / "cache").exists()  # no base was built
    assert (tmp_path / "a_file").read_text() == "" and sorted(os.listdir(tmp_path / "a_run")) == ["metrics.jsonl"]


@pytest.mark.parametrize("error", [None, 0.5])
def test_sft_of_a_users_model_learns_their_demonstrations_unless_a_teacher_error_is_set(tmp_path, monkeypatch,
                                                                                        shared_dir, error):
    """``trustbatch sft model.path=DIR`` swapped 25 % of the user's answers (the default base's weak teacher) without
    a word. Now only when ``model.sft_teacher_error`` is set. The demonstrations are compared with the data file."""
    import json

    from typer.testing import CliRunner

    from trustbatch.cli import app

    seen = []
    monkeypatch.setattr("trustbatch.policy.sft.sft", lambda policy, demos, **kw: seen.extend(demos) or 0.0)
    data = shared_dir / "data" / "gsm8k" / "train.jsonl"
    args = ["sft", f"model.path={shared_dir / 'models' / 'stories260K-hf'}", f"data.train={data}",
            "model.sft_examples=40", "data.heldout_size=8", "--out", str(tmp_path / "out")]
    if error is not None:
        args.insert(-2, f"model.sft_teacher_error={error}")
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    final = {r["question"]: r["answer"].split("####")[-1].strip() for r in rows}  # the gold number of each question
    assert 30 <= len(seen) <= 40  # less those past stories260K's 512 positions (tests/integration/test_sft_inputs.py)
    swapped = sum(final[next(q for q in final if q in prompt)] != completion.split("####")[-1].strip()
                  for prompt, completion in seen)
    assert swapped == 0 if error is None else swapped >= 10


# ---- a run's stdout to a file, its samples -------------------------------------------------------------------

def test_a_run_logged_to_a_file_has_unwrapped_lines_with_eta_and_writes_samples(tmp_path, cache, support_on_pythonpath):
    import json
    import os

    import reasoning_gym
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    # COLUMNS=40: rich would wrap any line longer than that; none may be
    done = subprocess.run(train_args(run_dir, "train.steps=4", "checkpoint_every=2"), cwd=ROOT, timeout=600,
                          stdout=open(log, "w"), stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "40"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = log.read_text().splitlines()
    header = [l for l in lines if l.startswith("trustbatch train objective=")]
    assert len(header) == 1 and "model=" in header[0] and header[0].endswith("(cached)")
    rounds = [l for l in lines if l.startswith("round ")]
    assert [l.split()[1] for l in rounds] == ["1/4", "2/4", "3/4", "4/4"], lines
    assert all("ETA" in l and "elapsed" in l for l in rounds)

    samples = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(s["round"], s["split"]) for s in samples] == [(r, "heldout") for r in (0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4)]
    heldout = configured_task(load_config(None, TINY)).heldout
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    for s in samples:
        i = [e.prompt for e in heldout].index(s["prompt"])
        assert i < 4  # the same first prompts at every evaluation
        assert s["reward"] == score(s["completion"].strip(), json.loads(heldout[i].reference))
        assert s["reference"] == heldout[i].reference and s["behaviour_logprob_sum"] < 0

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = acc.Tensors("samples/heldout/text_summary")
    assert [t.step for t in texts] == [0, 2, 4]
    last = texts[-1].tensor_proto.string_val[0].decode()
    assert all(s["prompt"] + s["completion"] in last for s in samples if s["round"] == 4)


def test_a_start_refused_for_its_input_leaves_no_directory_to_call_interrupted(tmp_path, cache):
    import io

    import pytest
    from rich.console import Console

    from trustbatch.errors import UserError
    from trustbatch.recipes import train

    run_dir = tmp_path / "run"
    quick = TINY + ["threads=1", "reward.workers=0", f"run_dir={run_dir}"]
    with pytest.raises(UserError, match="distinct prompts"):  # refused in prepare_run, after the directory was made
        train(load_config(None, quick + ["task.heldout_size=5000"]), console=Console(file=io.StringIO()))
    assert not run_dir.exists()
    out = io.StringIO()
    train(load_config(None, quick + ["train.steps=1"]), console=Console(file=out, width=200))
    assert "before its first checkpoint" not in out.getvalue()
    assert not [p for p in run_dir.iterdir() if p.name.startswith("interrupted-")]


def test_the_truncation_warning_says_when_the_context_holds_no_more(tmp_path, cache):
    import io

    from rich.console import Console

    from trustbatch.recipes import train
    from trustbatch.recipes.hooks import truncation_advice

    task, policy, pool, _ = prepare_run(load_config(None, TINY + ["reward.workers=0"]))
    pool.close()
    longest = max(len(policy.encode_prompt(e.prompt)) for e in task.train)
    context = policy.model.config.max_position_embeddings  # the tiny base's model.max_len
    out = io.StringIO()
    train(load_config(None, TINY + [f"rollout.max_new_tokens={context - longest}", "train.steps=1", "threads=1",
                                    "reward.workers=0", f"run_dir={tmp_path / 'run'}"]),
          console=Console(file=out, width=100))
    warned = [line for line in out.getvalue().splitlines() if "were cut at" in line]
    assert len(warned) == 1, out.getvalue()
    assert (f"the model's context of {context} tokens cannot hold more beside the longest prompt ({longest} tokens)"
            in warned[0]) and "raise rollout.max_new_tokens" not in warned[0]
    # with room left, the advice is the budget that still keeps every prompt: 64 - 20 = 44 tokens
    assert truncation_advice(8, 64, 20).startswith("raise rollout.max_new_tokens (up to 44 keeps every prompt")
    assert truncation_advice(44, 64, 20).startswith("the model's context of 64 tokens cannot hold more")


# ---- Ctrl-C before the first checkpoint ----------------------------------------------------------------------

def test_ctrl_c_before_the_first_checkpoint_says_so_and_the_directory_starts_again(tmp_path, cache,
                                                                                  support_on_pythonpath):
    run_dir = tmp_path / "run"
    # an in-process scorer that never returns: the base's evaluation never ends, so no checkpoint is written
    hang = ["reward.name=scorers_for_tests:hang_always", "reward.workers=0"]
    proc = start(train_args(run_dir, *hang), tmp_path / "first.log")
    try:
        wait_until(proc, lambda: (run_dir / "scoring_in_process.json").exists(), "the first scoring call")
    finally:
        rc, err = signal_and_wait(proc, signal.SIGINT, tmp_path / "first.log")
    assert rc == 130, err[-3000:]
    assert one_line(err) == ("trustbatch: interrupted before the first checkpoint; nothing to resume; run again with "
                             "the same command to start over")
    assert not list((run_dir / "checkpoints").glob("step_*"))
    first_config = (run_dir / "config.yaml").read_text()

    again = run(train_args(run_dir, "train.steps=1"))  # the same run_dir, not refused
    assert again.returncode == 0, again.stderr[-3000:]
    kept = [p for p in run_dir.iterdir() if p.name.startswith("interrupted-")]
    assert len(kept) == 1 and f"its files are kept in {kept[0]}" in again.stdout
    assert (kept[0] / "config.yaml").read_text() == first_config  # the first start's files, moved, not deleted
    assert (run_dir / "summary.json").is_file() and (run_dir / "checkpoints" / "step_000001").is_dir()
    # a directory that holds a checkpoint is still refused, never set aside
    refused = run(train_args(run_dir, "train.steps=1"))
    assert refused.returncode == 2 and "already holds a run" in one_line(refused.stderr)
