"""Issue 10: a kill -9 at any moment, then ``--resume``, continues bit-identically to a run never interrupted.

Every comparison is against a second, uninterrupted run of the same config (real processes, real files):
the final checkpoint's tensors with ``torch.equal``, and every metrics and ratio-histogram record (timing
fields aside). Also the resume rules (what a resume may change) and recovery from a crash before the
first checkpoint, a corrupt newest checkpoint and leftover temporary checkpoint folders.
"""

import json
import math
import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest

from trustbatch.cli import main
from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train
from trustbatch.trainer.checkpoint import checkpoints

from runproc import (cache, n_records, one_line, records, resume_args, run, snapshot, start, tmp_checkpoints,  # noqa: F401
                     assert_same_weights, train_args, wait_until)
from tiny import TINY

SHIFTED = ["rollout.staleness=2", "train.epochs=2", "train.minibatches=2", "rollout.precision=bfloat16"]

# kill points: ("round", n) after round n's record is written; ("ckpt", n) while a checkpoint folder is
# being written (a .tmp-* folder exists) once round n's record is written, i.e. round n's checkpoint
# a cosine schedule with warm-up and other AdamW settings (issue 45 item 4): the schedule continues exactly too
SCHEDULE = ["train.lr_schedule=cosine", "train.warmup_steps=3", "train.adam_betas=[0.8,0.95]", "train.adam_eps=1e-6"]
CASES = {  # the default suite: p3o with every shift that keeps state across rounds, and the reward pool
    "p3o_stale_replay_bf16_workers2_cosine": (SHIFTED + SCHEDULE, [("ckpt", 1), ("round", 3)]),
}
SLOW_CASES = {
    "p3o_workers2": ([], [("round", 2), ("ckpt", 4)]),
    "p3o_workers0_late": (["reward.workers=0"], [("round", 1), ("ckpt", 3), ("ckpt", 5)]),
    "grpo_stale_replay_bf16_workers2": (SHIFTED + ["objective.name=grpo"], [("ckpt", 2), ("round", 5)]),
}


def _kill_at(run_dir, args, point, log):
    kind, n = point
    proc = start(args, log)
    try:
        if kind == "round":
            wait_until(proc, lambda: n_records(run_dir) >= n + 1, f"round {n}")
        else:
            wait_until(proc, lambda: n_records(run_dir) >= n + 1 and tmp_checkpoints(run_dir),
                       f"a checkpoint write after round {n}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (run_dir / "summary.json").exists(), "killed after the run had finished"


def _crash_resume_matches_uninterrupted(tmp_path, extra, points):
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    uninterrupted = start(train_args(ref, *extra), tmp_path / "ref.log")  # in parallel with the killed one
    try:
        _kill_at(run_dir, train_args(run_dir, *extra), points[0], tmp_path / "kill0.log")
        for i, point in enumerate(points[1:], 1):
            _kill_at(run_dir, resume_args(run_dir), point, tmp_path / f"kill{i}.log")
        (run_dir / "checkpoints" / ".tmp-left-by-a-crash").mkdir(exist_ok=True)
        done = run(resume_args(run_dir))
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        assert uninterrupted.wait(timeout=300) == 0, (tmp_path / "ref.log.err").read_text()[-3000:]
    assert_same_weights(ref / "checkpoints" / "step_000006", run_dir / "checkpoints" / "step_000006")
    assert records(run_dir) == records(ref)
    assert records(run_dir, "ratios.jsonl") == records(ref, "ratios.jsonl")
    segments = records(run_dir, "segments.jsonl")
    assert len(segments) == len(points) + 1
    assert segments[0]["start_round"] == 0 and all(s["changed"] == [] for s in segments)
    assert not tmp_checkpoints(run_dir)  # leftover temporary folders are removed on resume
    return segments


@pytest.mark.parametrize("case", list(CASES))
def test_kill9_at_several_points_then_resume_is_bit_identical(tmp_path, cache, case):
    segments = _crash_resume_matches_uninterrupted(tmp_path, *CASES[case])
    # a kill during round 1's checkpoint write leaves only the step-0 checkpoint: that resumes too
    if CASES[case][1][0] == ("ckpt", 1):
        assert segments[1]["start_round"] == 0
    if SCHEDULE[0] in CASES[case][0]:  # the lr each optimizer step k (4 a round) uses, by hand: warm-up, cosine
        lr, warm, total = load_config(None, TINY).train.lr, 3, 6 * 4
        f = [(k + 1) / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm)))
             for k in range(total)]
        logged = [(x["step"], x["opt_step"], x["lr"]) for x in records(tmp_path / "run", "steps.jsonl")]
        assert [(r, j) for r, j, _ in logged] == [(r, j) for r in range(1, 7) for j in range(4)]
        assert [x for _, _, x in logged] == pytest.approx([lr * v for v in f], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_kill9_then_resume_is_bit_identical_more_cases(tmp_path, cache, case):
    _crash_resume_matches_uninterrupted(tmp_path, *SLOW_CASES[case])


@pytest.mark.slow
def test_kill9_before_the_first_checkpoint_every_resumes_from_step_0(tmp_path, cache):
    extra = ["checkpoint_every=100", "reward.workers=0"]
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    uninterrupted = start(train_args(ref, *extra), tmp_path / "ref.log")
    _kill_at(run_dir, train_args(run_dir, *extra), ("round", 3), tmp_path / "kill.log")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step_000000"]
    done = run(resume_args(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert uninterrupted.wait(timeout=300) == 0
    assert_same_weights(ref / "checkpoints" / "step_000006", run_dir / "checkpoints" / "step_000006")
    assert records(run_dir) == records(ref)


# ---- in-process: resume rules and a corrupt newest checkpoint --------------------------------------------

QUICK = TINY + ["checkpoint_every=1", "threads=1", "reward.workers=0"]


def _cli(monkeypatch, capsys, *argv) -> tuple[int, str]:
    """``trustbatch`` through ``cli.main`` in this process: (exit code, stderr)."""
    monkeypatch.setattr("sys.argv", ["trustbatch", *argv])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_resume_may_change_only_resumable_keys_and_keeps_finished_runs(tmp_path, cache, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    t0 = time.time()
    train(load_config(None, QUICK + ["train.steps=2", f"run_dir={run_dir}"]))
    first = time.time() - t0
    before = snapshot(run_dir)
    first_wall = json.loads((run_dir / "summary.json").read_text())["wall_s"]

    code, err = _cli(monkeypatch, capsys, "train", "--resume", str(run_dir), "train.lr=0.01")
    assert code == 2 and "train.lr" in one_line(err) and "Traceback" not in err
    assert snapshot(run_dir) == before  # config.yaml byte-identical, nothing else touched

    code, err = _cli(monkeypatch, capsys, "train", "--resume", str(run_dir))
    assert code == 2 and "already finished" in one_line(err) and "train.steps" in err
    assert snapshot(run_dir) == before  # summary.json byte-identical

    # a run from before task.heldout_reserve existed: its base skipped the held-out prompts alone, and still does;
    # one from before rollout.prompt_order drew its prompts at random, and still does
    saved = (run_dir / "config.yaml").read_text()
    assert "  prompt_order: epochs\n" in saved
    (run_dir / "config.yaml").write_text(saved.replace("  heldout_reserve: 0\n", "").replace("  prompt_order: epochs\n", ""))
    t0 = time.time()
    code, err = _cli(monkeypatch, capsys, "train", "--resume", str(run_dir), "train.steps=3")
    resumed = time.time() - t0
    assert code == 0, err
    wall = json.loads((run_dir / "summary.json").read_text())["wall_s"]
    # both segments: the first's own wall time plus some of the second's, at most the two as timed from outside
    # (the resume's command-line overhead is outside its segment, so `resumed` alone is no lower bound)
    assert first_wall < wall <= first + resumed
    assert "steps: 3" in (run_dir / "config.yaml").read_text() and "  heldout_reserve: 0\n" in saved
    assert (run_dir / "config.yaml").read_text() == saved.replace("  steps: 2\n", "  steps: 3\n").replace(
        "prompt_order: epochs", "prompt_order: random")
    assert [r["step"] for r in records(run_dir)] == [0, 1, 2, 3]
    segments = records(run_dir, "segments.jsonl")
    assert [(s["start_round"], s["rounds"], s["changed"]) for s in segments] == [(0, 2, []), (2, 3, ["train.steps"])]
    assert all(s["cwd"] == os.getcwd() for s in segments)  # what relative paths are relative to


@pytest.fixture(scope="module")
def four_rounds(cache, tmp_path_factory):
    """An uninterrupted 4-round run (in this process)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train(load_config(None, QUICK + ["train.steps=4", f"run_dir={run_dir}"]))
    return run_dir


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer_state.pt"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, cache, four_rounds, damaged):
    run_dir = tmp_path / "run"
    train(load_config(None, QUICK + ["train.steps=3", f"run_dir={run_dir}"]))
    newest = run_dir / "checkpoints" / "step_000003" / damaged
    torn = newest.read_bytes()[: newest.stat().st_size // 2]
    newest.write_bytes(torn)  # torn by a crash or a full disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(resume=str(run_dir), overrides=["train.steps=4"])
    assert any("step_000003" in str(w.message) and "previous" in str(w.message) for w in caught)
    assert records(run_dir, "segments.jsonl")[-1]["start_round"] == 2
    # the torn checkpoint is kept aside, out of the rotation (which kept a torn one and deleted an intact one)
    assert (run_dir / "checkpoints" / "unloadable-step_000003" / damaged).read_bytes() == torn
    assert [p.name for p in checkpoints(run_dir)] == ["step_000003", "step_000004"]
    # round 2's checkpoint of a 3-round run is round 2's of a 4-round run: the rest is the uninterrupted run
    assert_same_weights(four_rounds / "checkpoints" / "step_000004", run_dir / "checkpoints" / "step_000004")
    assert records(run_dir) == records(four_rounds)


def test_a_resume_that_raises_train_steps_steps_at_the_new_schedules_rates_from_its_first_step(tmp_path, cache):
    """A finished 2-round cosine run (2 optimizer steps a round) extended to 4 rounds: the resumed segment's first
    step ran at the old schedule's next rate (0: the decay had ended) and only the second at the new one's. The
    rates, by hand: warm-up over 2 steps, then cosine to 0 just after the 8th step."""
    run_dir = tmp_path / "run"
    sched = ["train.lr_schedule=cosine", "train.warmup_steps=2", "train.minibatches=2"]
    train(load_config(None, QUICK + sched + ["train.steps=2", f"run_dir={run_dir}"]))
    train(resume=str(run_dir), overrides=["train.steps=4"])
    lr, warm, total = load_config(None, TINY).train.lr, 2, 4 * 2
    f = [(k + 1) / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm)))
         for k in range(total)]
    logged = [x["lr"] for x in records(run_dir, "steps.jsonl") if x["step"] > 2]
    assert logged == pytest.approx([lr * v for v in f[4:]], rel=1e-12)


def test_an_older_runs_config_resumes_and_exports_as_it_trained(tmp_path, four_rounds):
    """config.yaml of a run made before keys and refusals were added: no rollout.prompt_order (it drew at random),
    objective.std=sample under advantage=rloo, data.heldout_size without data.train, rollout.quantization on the
    transformers engine (each read by nothing then). Resume and export read it as it trained; they refused it, and
    the export card named the new default prompt order."""
    from trustbatch.recipes.export import export_run
    from trustbatch.recipes.train import resolved_config

    run_dir = tmp_path / "old"
    shutil.copytree(four_rounds, run_dir)
    text = (run_dir / "config.yaml").read_text()
    for old, new in (("  prompt_order: epochs\n", ""), ("  advantage: zscore\n", "  advantage: rloo\n"),
                     ("  std: population\n", "  std: sample\n"), ("  heldout_size: 256\n", "  heldout_size: 16\n"),
                     ("  quantization: null\n", "  quantization: fp8_per_channel\n")):
        assert old in text, old
        text = text.replace(old, new)
    (run_dir / "config.yaml").write_text(text)
    cfg = resolved_config(resume=str(run_dir), overrides=["train.steps=5"])
    assert (cfg.rollout.prompt_order, cfg.objective.advantage, cfg.objective.std) == ("random", "rloo", "population")
    assert (cfg.data.heldout_size, cfg.rollout.quantization) == (256, None)
    card = (Path(export_run(run_dir, tmp_path / "export")["out"]) / "README.md").read_text()
    assert "prompt_order: random" in card and "std: population" in card


def test_resumes_that_would_redo_or_skip_recorded_rounds_are_refused(tmp_path, four_rounds, monkeypatch, capsys):
    """Each refusal is one line, and leaves every file of the run byte-identical: a run stopped after round 4 (no
    summary) resumed with train.steps below 4 (it "finished" untrained, its summary naming the base's accuracy); a
    run whose checkpoints are gone (it restarted from round 0 over its records); run_dir naming another place (it
    was ignored)."""
    import shutil

    stopped = tmp_path / "stopped"
    shutil.copytree(four_rounds, stopped)
    (stopped / "summary.json").unlink()
    gone = tmp_path / "gone"
    shutil.copytree(four_rounds, gone)
    shutil.rmtree(gone / "checkpoints")
    (gone / "checkpoints").mkdir()
    # round 4 checkpointed but not evaluated (a kill after the save): ending there left the summary's "final"
    # accuracy an older round's
    unevaluated = tmp_path / "unevaluated"
    shutil.copytree(stopped, unevaluated)
    recs = [json.loads(x) for x in (unevaluated / "metrics.jsonl").read_text().splitlines()]
    recs[-1] = {k: v for k, v in recs[-1].items() if not k.startswith("heldout_")}
    (unevaluated / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cases = [(stopped, ["train.steps=3"], "has trained 4 rounds (its last checkpoint); train.steps=3 is too few"),
             (unevaluated, ["train.steps=4"], "(its last checkpoint, and that round was not evaluated); train.steps=4 "
                                              "is too few: set train.steps=5 or more"),
             (gone, ["train.steps=6"], "has no checkpoint to resume from, but its records hold 4 trained rounds"),
             (four_rounds, ["train.steps=6", f"run_dir={tmp_path / 'elsewhere'}"], "a resume continues in the run's own")]
    for run_dir, overrides, said in cases:
        before = snapshot(run_dir)
        code, err = _cli(monkeypatch, capsys, "train", "--resume", str(run_dir), *overrides)
        assert code == 2 and said in one_line(err), err
        assert snapshot(run_dir) == before
    assert not (tmp_path / "elsewhere").exists()


def test_a_resume_that_trains_more_rounds_leaves_no_summary_until_it_writes_its_own(tmp_path, four_rounds,
                                                                                    monkeypatch):
    """The finished segment's summary.json stayed through a resume killed mid-way: reports showed the run finished,
    and a later resume was refused as "already finished at round 4" for a run whose summary said round 3."""
    import importlib
    import shutil

    train_mod = importlib.import_module("trustbatch.recipes.train")  # the package's `train` is the function
    run_dir = tmp_path / "run"
    shutil.copytree(four_rounds, run_dir)

    def killed(*args, **kwargs):
        raise RuntimeError("killed in round 5")

    monkeypatch.setattr(train_mod, "run_loop", killed)
    with pytest.raises(RuntimeError, match="killed in round 5"):
        train(None, resume=str(run_dir), overrides=["train.steps=6"])
    assert not (run_dir / "summary.json").exists()
    monkeypatch.undo()
    # a summary of an earlier segment (round 3) does not make round 4's checkpoint a finished run
    stale = json.loads((four_rounds / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**stale, "steps": 3}))
    assert train(None, resume=str(run_dir), overrides=["train.steps=4"])["steps"] == 4


def test_resume_of_a_run_older_than_a_config_key():
    from trustbatch.recipes.rundir import check_resume_changes

    defaults = {"train": {"steps": 10, "lr": 3e-4}, "ray_learners": 1}
    saved = {"train": {"steps": 10, "lr": 3e-4}}  # written before ray_learners existed
    assert check_resume_changes(saved, {"train": {"steps": 20, "lr": 3e-4}, "ray_learners": 1}, defaults) == ["train.steps"]
    with pytest.raises(UserError, match="ray_learners"):  # not the default: the run would compute something else
        check_resume_changes(saved, {"train": {"steps": 10, "lr": 3e-4}, "ray_learners": 2}, defaults)
    with pytest.raises(UserError, match="ray_learners"):  # without defaults the old strict rule holds
        check_resume_changes(saved, {"train": {"steps": 10, "lr": 3e-4}, "ray_learners": 1})


def test_checkpoint_keep_keeps_the_newest_n_and_a_resume_may_change_it(tmp_path, cache):
    run_dir = tmp_path / "run"
    train(load_config(None, QUICK + ["train.steps=3", "checkpoint_keep=1", f"run_dir={run_dir}"]))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000003"]
    train(None, resume=str(run_dir), overrides=["train.steps=5", "checkpoint_keep=3"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_00000{k}" for k in (3, 4, 5)]


def test_the_refusal_and_the_guide_name_every_resumable_key_and_a_missing_run_is_named(tmp_path):
    """The refusal's list and reliability.md's are RESUMABLE_KEYS, all of them (the line once left the last out and
    the guide five); a --resume of a directory that does not exist says so."""
    import re

    from runproc import ROOT
    from trustbatch.recipes.rundir import RESUMABLE_KEYS, check_resume_changes

    with pytest.raises(UserError) as e:
        check_resume_changes({"train": {"lr": 0.1}}, {"train": {"lr": 0.2}})
    assert e.value.args[0].rsplit("(a resume may change ", 1)[1].rstrip(")").split(", ") == list(RESUMABLE_KEYS)
    row = next(line for line in (ROOT / "docs" / "guide" / "reliability.md").read_text().splitlines()
               if line.startswith("| **What a resume may change**"))
    assert re.findall(r"`([\w.]+)`", row.split(";")[0]) == list(RESUMABLE_KEYS)
    with pytest.raises(UserError, match="no such directory"):
        train(resume=str(tmp_path / "nope"))


def test_a_resume_from_another_directory_whose_relative_paths_name_other_files_is_refused(tmp_path, monkeypatch):
    """config.yaml keeps paths as typed: from another directory a relative data path names nothing, or another
    file (silently other data), and giving it absolute is a refused change. The line names the start directory."""
    from trustbatch.recipes.rundir import check_resume_paths

    start, other, run = tmp_path / "start", tmp_path / "other", tmp_path / "run"
    for d in (start / "data", other / "data", run):
        d.mkdir(parents=True)
    (start / "data" / "rows.jsonl").write_text("start\n")
    (run / "segments.jsonl").write_text(json.dumps({"start_round": 0, "cwd": str(start)}) + "\n")
    (run / "config.yaml").write_text("data:\n  train: data/rows.jsonl\n  dir: null\n")
    saved = {"data": {"train": "data/rows.jsonl", "dir": None}, "task": {"name": "chain_sum"}}
    monkeypatch.chdir(other)
    with pytest.raises(UserError) as e:  # wired into --resume, before anything loads
        train(resume=str(run))
    assert f"data.train='data/rows.jsonl' is relative to {start}" in str(e.value)
    assert "does not exist from here" in str(e.value) and f"cd {start} && trustbatch train --resume {run}" in str(e.value)
    (other / "data" / "rows.jsonl").write_text("other\n")  # a file of the same name, here: another file
    with pytest.raises(UserError, match="is another file from here"):
        check_resume_paths(saved, run)
    monkeypatch.chdir(start)  # from the start directory: the run's own files
    check_resume_paths(saved, run)
    monkeypatch.chdir(other)
    check_resume_paths({"data": {"train": str(start / "data" / "rows.jsonl")}}, run)  # absolute: the same anywhere
    (run / "segments.jsonl").write_text(json.dumps({"start_round": 0}) + "\n")  # a run from before cwd was recorded
    check_resume_paths(saved, run)
