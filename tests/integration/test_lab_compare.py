"""``trustbatch lab compare``: a re-run checked against the archive value for value (issue 14, item 9)."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from trustbatch.cli import app
from trustbatch.errors import UserError
from trustbatch.lab import load_experiment, run_experiment
from trustbatch.lab.archive import archive_runs
from trustbatch.lab.reproduce import compare_run, compare_runs, comparison_line

from tiny import TINY

CFG = {"train": {"seed": 0, "lr": 3e-4}, "objective": {"name": "p3o", "options": {}}, "run_dir": "/a"}
RECORDS = [
    {"step": 0, "heldout_accuracy": 0.25},
    {"step": 1, "ess": 0.99, "loss": -0.5, "rollout_s": 0.3, "tokens_per_s": 1000.0, "entropy": float("nan")},
    {"step": 2, "ess": 0.98, "loss": -0.4, "rollout_s": 0.2, "heldout_accuracy": 0.30},
]


def _run(root, exp, arm, seed, records, cfg=CFG):
    d = root / exp / arm / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({"wall_s": 60.0}))
    (root / exp / arm / f"seed{seed}.yaml").write_text(yaml.safe_dump(cfg))
    return d


def test_wall_clock_and_run_dir_differ_yet_the_runs_are_identical(tmp_path):
    old = _run(tmp_path / "archive", "e", "p3o@x", 0, RECORDS)
    timed = [{k: v + 1.0 if k.endswith("_s") else v for k, v in r.items()} for r in RECORDS]
    new = _run(tmp_path / "runs", "e", "p3o@x", 0, timed, {**CFG, "run_dir": "/b"})
    c = compare_run(old, new, "e", "p3o@x", "seed0")
    # wall-clock keys left out; step 0: step, heldout_accuracy -> 2; step 1: step, ess, loss, entropy -> 4;
    # step 2: step, ess, loss, heldout_accuracy -> 4
    assert (c.values, c.differing, c.first, c.config_diff) == (10, 0, None, [])
    assert c.identical and c.score_max_abs_diff == 0.0  # NaN entropy on both sides counts as equal
    assert comparison_line(c) == "e p3o@x seed0: identical (3 records, 10 values)"


def test_the_first_difference_and_the_score_gap_are_named(tmp_path):
    old = _run(tmp_path / "archive", "e", "a", 1, RECORDS)
    changed = [RECORDS[0], {**RECORDS[1], "loss": -0.6}, {**RECORDS[2], "ess": 0.5, "heldout_accuracy": 0.2875}]
    new = _run(tmp_path / "runs", "e", "a", 1, changed)
    c = compare_run(old, new, "e", "a", "seed1")
    assert not c.identical and c.differing == 3 and c.first == (1, "loss", -0.5, -0.6)
    assert c.score_max_abs_diff == pytest.approx(0.30 - 0.2875)
    line = comparison_line(c)
    assert "differs: 3 of 10 values, first at step 1 loss (-0.5 archived, -0.6 re-run)" in line and "0.0125" in line


def test_keys_redefined_since_the_archives_are_not_compared_and_the_rest_is(tmp_path):
    """``ratio_max`` (a mean of the steps' maxima in the archives, their maximum now), ``heldout_pass@8`` (counted at
    reward >= 0.5 then, at the full reward now) and dynamic sampling's ``truncated_fraction`` are other quantities
    under the same names: a re-run that differs only there is identical; one that differs elsewhere is not."""
    old_recs = [{**r, "ratio_max": 2.0, "heldout_pass@8": 0.5, "truncated_fraction": 0.1} for r in RECORDS]
    new_recs = [{**r, "ratio_max": 3.0, "heldout_pass@8": 0.4, "truncated_fraction": 0.3} for r in RECORDS]
    old = _run(tmp_path / "archive", "e", "a", 0, old_recs)
    c = compare_run(old, _run(tmp_path / "runs", "e", "a", 0, new_recs))
    assert c.identical and c.values == 10  # the 10 of the first test: the redefined keys are left out
    moved = [new_recs[0], {**new_recs[1], "ess": 0.5}, new_recs[2]]
    c2 = compare_run(old, _run(tmp_path / "runs2", "e", "a", 0, moved))
    assert c2.first == (1, "ess", 0.99, 0.5) and c2.differing == 1


def test_a_shorter_re_run_and_a_changed_config_are_not_identical(tmp_path):
    old = _run(tmp_path / "archive", "e", "a", 0, RECORDS)
    short = _run(tmp_path / "runs", "e", "a", 0, RECORDS[:2])
    c = compare_run(old, short)
    # the missing record's step and 3 values (ess, loss, heldout_accuracy) count as compared and differing
    assert not c.identical and c.records == (3, 2) and (c.values, c.differing) == (10, 4)
    assert c.first == (2, "step", 2, "<absent>") and c.score_max_abs_diff == 0.0  # only step 0's score is paired
    other = _run(tmp_path / "runs2", "e", "a", 0, RECORDS, {**CFG, "train": {"seed": 0, "lr": 1e-3}})
    c2 = compare_run(old, other, "e", "a", "seed0")
    assert c2.config_diff == ["train.lr"] and not c2.identical
    assert "config differs (train.lr)" in comparison_line(c2)


def test_only_runs_the_archive_holds_are_compared_and_bad_folders_are_one_error(tmp_path):
    _run(tmp_path / "archive", "e", "a", 0, RECORDS)
    _run(tmp_path / "runs", "e", "a", 0, RECORDS)
    _run(tmp_path / "runs", "e", "new_arm", 0, RECORDS)  # not archived: skipped
    got = compare_runs(tmp_path / "runs", tmp_path / "archive")
    assert [(c.arm, c.seed, c.identical) for c in got] == [("a", "seed0", True)]
    with pytest.raises(UserError, match="not a folder"):
        compare_runs(tmp_path / "nope", tmp_path / "archive")
    with pytest.raises(UserError, match="other is not under --runs"):
        compare_runs(tmp_path / "runs", tmp_path / "archive", ["other"])
    _run(tmp_path / "runs3", "e", "b", 0, RECORDS)
    with pytest.raises(UserError, match="no finished run"):
        compare_runs(tmp_path / "runs3", tmp_path / "archive")


def test_cli_exits_1_when_a_re_run_differs(tmp_path):
    _run(tmp_path / "archive", "e", "a", 0, RECORDS)
    _run(tmp_path / "runs", "e", "a", 0, RECORDS)
    args = ["lab", "compare", "--runs", str(tmp_path / "runs"), "--archive", str(tmp_path / "archive")]
    ok = CliRunner().invoke(app, args)
    assert ok.exit_code == 0 and "1 of 1 re-runs identical" in ok.output
    (tmp_path / "runs" / "e" / "a" / "seed0" / "metrics.jsonl").write_text(json.dumps({**RECORDS[0], "heldout_accuracy": 0.5}) + "\n")
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code == 1 and "0 of 1 re-runs identical" in bad.output and "differs" in bad.output


def test_a_real_run_repeated_at_one_commit_is_identical_and_a_changed_one_is_not(tmp_path, monkeypatch):
    """The property the archive check rests on: training is deterministic on one machine. Two runs of the same
    config into different folders log equal values; a different learning rate parts from it after the first
    update, and the comparison names that round."""
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    common.update({"train.steps": 2, "eval.every": 1, "checkpoint_every": 1})
    spec = {"description": "tiny", "common": common, "seeds": [0], "arms": {"p3o@x": {"objective.name": "p3o"}}}
    f = tmp_path / "tiny_rep.yaml"
    f.write_text(yaml.safe_dump(spec))
    exp = load_experiment(str(f))
    assert run_experiment(exp, tmp_path / "first", jobs=1)["failed"] == []
    archive_runs(tmp_path / "first", tmp_path / "archive")
    assert run_experiment(exp, tmp_path / "again", jobs=1)["failed"] == []
    [c] = compare_runs(tmp_path / "again", tmp_path / "archive")
    # rounds 0 (the base's evaluation), 1 and 2, with every logged metric
    assert c.identical and c.records == (3, 3) and c.values > 3 * 10, comparison_line(c)
    spec["arms"]["p3o@x"]["train.lr"] = 0.05
    f.write_text(yaml.safe_dump(spec))
    assert run_experiment(load_experiment(str(f)), tmp_path / "changed", jobs=1)["failed"] == []
    [d] = compare_runs(tmp_path / "changed", tmp_path / "archive")
    assert d.config_diff == ["train.lr"]
    # the base's evaluation and the first batch's statistics are the same; the logged learning rate is not
    assert d.differing > 0 and d.first[:2] == (1, "lr")


def test_a_missing_resolved_config_is_named(tmp_path):
    old = _run(tmp_path / "archive", "e", "a", 0, RECORDS)
    new = _run(tmp_path / "runs", "e", "a", 0, RECORDS)
    (tmp_path / "archive" / "e" / "a" / "seed0.yaml").unlink()
    c = compare_run(old, new)
    assert not c.identical and c.differing == 0
    assert c.config_diff == [f"{tmp_path / 'archive' / 'e' / 'a' / 'seed0.yaml'} missing"]
    assert "no resolved config to check" in comparison_line(c)


def test_record_is_written_into_the_archive_and_the_report_says_it(tmp_path):
    from trustbatch.lab.report import experiment_section
    from trustbatch.lab.reproduce import RECORD, record_comparisons, reproduced_line

    for arm in ("p3o@x", "grpo@x"):
        _run(tmp_path / "archive", "e", arm, 0, RECORDS)
    (tmp_path / "archive" / "e" / "experiment.yaml").write_text("description: d\n")
    _run(tmp_path / "runs", "e", "p3o@x", 0, RECORDS)
    _run(tmp_path / "runs", "e", "grpo@x", 0, [RECORDS[0], RECORDS[1], {**RECORDS[2], "heldout_accuracy": 0.25}])
    (tmp_path / "runs" / "e" / "calls.jsonl").write_text(
        json.dumps({"start": 1.0, "end": 2.0, "commit": "abc1234"}) + "\n" + json.dumps({"legacy_wall_s": 5}) + "\n")
    results = compare_runs(tmp_path / "runs", tmp_path / "archive")
    [path] = record_comparisons(results, tmp_path / "runs", tmp_path / "archive")
    assert path == tmp_path / "archive" / "e" / RECORD
    rec = json.loads(path.read_text())
    assert rec["commits"] == ["abc1234"]  # the untimed legacy record names no commit
    by_arm = {r["arm"]: r for r in rec["runs"]}
    assert by_arm["p3o@x"]["identical"] and not by_arm["grpo@x"]["identical"]
    assert by_arm["grpo@x"]["first"] == [2, "heldout_accuracy", 0.30, 0.25]
    assert by_arm["p3o@x"]["first"] is None
    line = reproduced_line(tmp_path / "archive" / "e")
    assert line.endswith("1 of 2 runs re-run at commit `abc1234` are identical to these, value for value, wall-clock "
                         "keys aside (p3o@x seed0); grpo@x seed0 differs from step 2 (heldout_accuracy), held-out "
                         "pass@1 by up to 0.050.")
    (tmp_path / "report").mkdir()
    text, _ = experiment_section("e", tmp_path / "archive" / "e", tmp_path / "report")
    assert line in text
    assert reproduced_line(tmp_path / "runs" / "e") is None  # no record: no line
    path.write_text("{not json")
    assert "unreadable" in reproduced_line(tmp_path / "archive" / "e")


def test_nan_scores_a_logged_null_and_a_missing_key(tmp_path):
    nan = float("nan")
    old = _run(tmp_path / "archive", "e", "a", 0, [{"step": 0, "heldout_accuracy": nan}, {"step": 1, "heldout_accuracy": 0.4, "x": None}])
    new = _run(tmp_path / "runs", "e", "a", 0, [{"step": 0, "heldout_accuracy": nan}, {"step": 1, "heldout_accuracy": 0.3}])
    c = compare_run(old, new)
    # NaN on both sides is equal and leaves the gap to the real one (0.1); a logged null is not a missing key
    assert c.score_max_abs_diff == pytest.approx(0.1) and c.differing == 2 and c.first == (1, "heldout_accuracy", 0.4, 0.3)
    same = _run(tmp_path / "runs2", "e", "a", 0, [{"step": 0, "heldout_accuracy": nan}, {"step": 1, "heldout_accuracy": 0.4}])
    c2 = compare_run(old, same)
    assert c2.differing == 1 and c2.first == (1, "x", None, "<absent>") and c2.score_max_abs_diff == 0.0


def test_unarchived_experiments_are_skipped_unless_named_and_a_linked_arm_counts_once(tmp_path):
    _run(tmp_path / "archive", "e", "onpolicy", 0, RECORDS)
    _run(tmp_path / "archive", "f", "onpolicy", 0, RECORDS)
    ref = _run(tmp_path / "runs", "e", "onpolicy", 0, RECORDS).parent
    (tmp_path / "runs" / "f").mkdir()
    (tmp_path / "runs" / "f" / "onpolicy").symlink_to(ref)  # the shared reference linked into f
    _run(tmp_path / "runs", "new_exp", "a", 0, RECORDS)  # never archived
    got = compare_runs(tmp_path / "runs", tmp_path / "archive")
    assert [(c.experiment, c.arm) for c in got] == [("e", "onpolicy")]
    with pytest.raises(UserError, match="new_exp is not under --archive"):
        compare_runs(tmp_path / "runs", tmp_path / "archive", ["new_exp"])
