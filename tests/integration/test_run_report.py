"""``trustbatch report RUN_DIR ... --out DIR``: runs overlaid in one figure and a Markdown table (issue 37 item 2),
and the held-out standard error it draws (``heldout_accuracy_se``)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trustbatch.config import load_config
from trustbatch.data import Example
from trustbatch.errors import UserError
from trustbatch.eval.heldout import evaluate_heldout
from trustbatch.lab.reproduce import compare_run
from trustbatch.recipes import train
from trustbatch.recipes.compare import config_differences, labels, load_run, plot_runs, write_comparison
from trustbatch.rewards import ScoreResult

from tiny import TINY


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real tiny runs that differ in train.lr alone (in-process scoring, one thread)."""
    root = tmp_path_factory.mktemp("runs")
    old = os.environ.get("TRUSTBATCH_CACHE")
    os.environ["TRUSTBATCH_CACHE"] = str(root / "cache")
    try:
        runs = []
        for name, lr in (("low", "3e-4"), ("high", "3e-3")):
            run = root / name
            train(load_config(None, TINY + ["train.steps=2", "threads=1", "reward.workers=0", f"run_dir={run}",
                                            f"train.lr={lr}"]))
            runs.append(run)
        yield runs
    finally:
        if old is None:
            del os.environ["TRUSTBATCH_CACHE"]
        else:
            os.environ["TRUSTBATCH_CACHE"] = old


def _table(page: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``heading``, header and rule left out."""
    body = page.split(heading, 1)[1].split("\n\n", 2)[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in body.splitlines()[2:]]


def test_the_table_names_exactly_the_key_the_runs_differ_in(two_runs, tmp_path):
    low, high = two_runs
    page_path = write_comparison([low, high], tmp_path / "cmp")
    page = page_path.read_text()
    assert page_path == tmp_path / "cmp" / "README.md" and (tmp_path / "cmp" / "runs.png").stat().st_size > 10_000
    # run_dir differs between the two saved configs, yet is not reported
    assert yaml.safe_load((low / "config.yaml").read_text())["run_dir"] != yaml.safe_load(
        (high / "config.yaml").read_text())["run_dir"]
    assert _table(page, "## Configuration differences") == [["`train.lr`", "`0.0003`", "`0.003`"]]
    rows = {r[0]: r for r in _table(page, "## Held-out accuracy")}
    for run in (low, high):
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in recs if "heldout_accuracy" in r]
        assert [r["step"] for r in evals] == [0, 2]  # TINY evaluates every 2 rounds, and the base
        last = evals[-1]
        final = f"{last['heldout_accuracy']:.3f} ± {last['heldout_accuracy_se']:.3f} (round 2)"
        wall = json.loads((run / "summary.json").read_text())["wall_s"]
        assert rows[run.name][1] == "2" and rows[run.name][3] == final
        number, unit = rows[run.name][5].split()
        # read back: a tiny run lasts seconds, shown to the tenth below 10 s or to the second below a minute
        assert unit == "s" and abs(float(number) - wall) <= (0.05 if wall < 9.95 else 0.5), (rows[run.name], wall)
        assert rows[run.name][6] == "1"  # one process


@pytest.mark.parametrize("wall_s,shown", [(2.4, "2.4 s"), (9.96, "10 s"), (42.3, "42 s"),
                                           (59.6, "1.0 min"), (210.0, "3.5 min"), (3600.0, "60.0 min")])
def test_a_short_wall_time_reads_in_seconds(tmp_path, wall_s, shown):
    """A run of a few seconds read "0.0 min"; below a minute the table gives seconds, above it minutes."""
    run = tmp_path / "short"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "heldout_accuracy": 0.5}) + "\n")
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"lr": 0.1}}))
    (run / "summary.json").write_text(json.dumps({"wall_s": wall_s, "world_size": 1}))
    page = write_comparison([run], tmp_path / "cmp").read_text()
    assert _table(page, "## Held-out accuracy")[0][5] == shown


def test_the_figure_has_a_panel_per_logged_metric(two_runs, tmp_path):
    runs = [load_run(p, p.name) for p in two_runs]
    panels = plot_runs(runs, tmp_path / "f.png")
    assert {"reward_mean", "heldout_accuracy", "ess", "kl_behavior", "clip_fraction", "cap_fraction",
            "response_length", "tokens_per_s"} <= set(panels)
    assert "kl_ref" not in panels  # P3O without a reference KL does not log it: no empty panel
    assert "kl_behavior_bound" not in panels  # a transformers-engine run logs the exact KL, not vLLM's bound
    for r in runs[0].records[1:]:  # as a vLLM run with kl=exact logs it
        r["kl_behavior_bound"] = 0.01
    assert "kl_behavior_bound" in plot_runs(runs, tmp_path / "g.png")


@pytest.mark.parametrize("damage", ["torn summary", "list summary", "list metrics line", "text step",
                                    "latin1 metrics line"])
def test_a_damaged_run_file_reads_as_a_resume_reads_it(tmp_path, damage):
    """trustbatch report ended in a traceback (exit 1) on a torn summary.json (a partial copy), a metrics line that
    is no object or has a text step, or bytes that are no UTF-8. Reference: the same run without the damage: an
    unreadable summary is an unfinished run (as --resume reads it), a line trustbatch did not write is skipped."""
    def run(name, broken):
        d = tmp_path / name
        d.mkdir()
        lines = [json.dumps({"step": 0, "heldout_accuracy": 0.25}).encode(), json.dumps({"step": 1}).encode()]
        extra = {"list metrics line": b"[1, 2]", "text step": json.dumps({"step": "2"}).encode(),
                 "latin1 metrics line": '{"step": 3, "note": "caf\u00e9"}'.encode("latin-1")}
        if damage == "latin1 metrics line":  # read with the byte replaced, its other fields kept
            extra["clean"] = json.dumps({"step": 3, "note": "caf\ufffd"}).encode()
        kept = extra["latin1 metrics line" if broken else "clean"] if "clean" in extra else (
            extra.get(damage) if broken else None)
        (d / "metrics.jsonl").write_bytes(b"\n".join(lines + ([kept] if kept else [])) + b"\n")
        (d / "config.yaml").write_text(yaml.safe_dump({"train": {"lr": 0.1}}))
        summary = {"torn summary": b'{"wall_s": 4', "list summary": b"[]"}.get(damage) if broken else None
        if summary is not None:
            (d / "summary.json").write_bytes(summary)
        return d

    clean, broken = run("clean", False), run("broken", True)
    want = _table(write_comparison([clean], tmp_path / "a").read_text(), "## Held-out accuracy")[0][1:]
    got = _table(write_comparison([broken], tmp_path / "b").read_text(), "## Held-out accuracy")[0][1:]
    assert got == want
    assert [r["step"] for r in load_run(broken, "b").records][:2] == [0, 1]


def test_identical_configs_say_so(two_runs, tmp_path):
    page = write_comparison([two_runs[0]], tmp_path / "one").read_text()
    assert "The resolved configurations are identical (run_dir aside)." in page


def test_a_key_one_config_lacks_is_a_difference(tmp_path):
    a = SimpleNamespace(config={"train.lr": 0.1, "train.steps": 5, "run_dir": "x"})
    b = SimpleNamespace(config={"train.lr": 0.1, "run_dir": "y", "log.trackers": ["wandb"]})
    assert config_differences([a, b]) == {"log.trackers": [None, ["wandb"]], "train.steps": [5, None]}


def test_a_section_null_in_one_run_and_set_in_another_is_its_keys_rows():
    a = SimpleNamespace(config={"model.lora": None, "train.lr": 0.1})
    b = SimpleNamespace(config={"model.lora.r": 4, "model.lora.alpha": 8.0, "train.lr": 0.1})
    assert config_differences([a, b]) == {"model.lora.alpha": [None, 8.0], "model.lora.r": [None, 4]}


def test_labels_are_the_shortest_unique_tails(tmp_path):
    assert labels([tmp_path / "x" / "seed0", tmp_path / "y" / "seed0"]) == ["x/seed0", "y/seed0"]
    assert labels([tmp_path / "a", tmp_path / "b"]) == ["a", "b"]
    with pytest.raises(UserError, match="given twice"):
        labels([tmp_path / "a", tmp_path / "." / "a"])


def test_a_directory_without_metrics_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no metrics.jsonl: not a trustbatch run directory"):
        write_comparison([tmp_path / "empty"], tmp_path / "out")
    p = subprocess.run([sys.executable, "-m", "trustbatch", "report", str(tmp_path / "empty"), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "has no metrics.jsonl" in lines[0], p.stderr
    assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_be_written_is_one_line_and_exit_2(two_runs, tmp_path):
    """Issue 46 item 2: an existing file, a path inside a file, a folder that cannot be made (/proc refuses it);
    the three commands run at once (each is a Python start)."""
    from runproc import one_line

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    cases = {str(afile): "is a file, not a folder", str(afile / "report"): "lies inside", "/proc/1/no/report":
             "cannot write --out"}
    procs = {out: subprocess.Popen([sys.executable, "-m", "trustbatch", "report", str(two_runs[0]), "--out", out],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for out in cases}
    for out, says in cases.items():
        _, err = procs[out].communicate(timeout=120)
        line = one_line(err)
        assert procs[out].returncode == 2 and says in line and repr(out) in line, err
    assert afile.read_text() == "not a folder"


def test_a_report_that_cannot_be_written_whole_keeps_the_earlier_one_and_is_one_line(two_runs, tmp_path):
    """The figure was saved straight into OUT/runs.png: a disk that filled mid-write (here a 64 KiB file-size limit)
    left half a PNG beside the earlier report's page, and a traceback."""
    import resource

    from runproc import one_line

    out = tmp_path / "report"
    write_comparison(two_runs, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before["runs.png"]) > 64 << 10

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    p = subprocess.run([sys.executable, "-m", "trustbatch", "report", *map(str, two_runs), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, preexec_fn=small_files)
    assert p.returncode == 2 and "cannot write the report" in one_line(p.stderr), p.stderr[-2000:]
    assert {q.name: q.read_bytes() for q in out.iterdir()} == before  # no temporary file left either


def test_a_readme_of_the_users_is_never_replaced_and_an_earlier_report_is(two_runs, tmp_path):
    """``report --out .`` in a project root replaced its README.md with the comparison, silently."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "README.md").write_text("# My project notes\n")
    with pytest.raises(UserError, match="holds a README.md that is no run comparison"):
        write_comparison(two_runs, mine)
    assert (mine / "README.md").read_text() == "# My project notes\n" and sorted(os.listdir(mine)) == ["README.md"]
    page = write_comparison(two_runs, tmp_path / "report")
    (page.parent / "README.md").write_text("# Run comparison\n\nstale\n")
    assert "stale" not in write_comparison(two_runs, tmp_path / "report").read_text()


class _Policy:
    def encode_prompt(self, prompt: str) -> list[int]:
        return [int(prompt)]

    def decode(self, ids: list[int]) -> str:
        return f"{ids[0]}:{ids[1]}"


class _Engine:
    def generate(self, prompts, n, sampling):
        return [SimpleNamespace(completion_ids=[p[0], j], prompt_index=i, truncated=False)
                for i, p in enumerate(prompts) for j in range(n)]


class _Pool:
    # prompt -> rewards of its samples (the greedy completion is sample 0)
    REWARDS = {0: [1.0, 1.0], 1: [1.0, 0.0], 2: [0.0, 0.0], 3: [0.25, 0.75]}

    def score(self, completions, references, **_):
        rewards = [self.REWARDS[int(c.split(":")[0])][int(c.split(":")[1])] for c in completions]
        return ScoreResult(rewards, errors=0, timeouts=0)


def test_heldout_standard_error_is_over_prompts():
    examples = [Example(str(i), "", "") for i in range(4)]
    m = evaluate_heldout(_Policy(), _Engine(), examples, _Pool(), samples_per_prompt=2, temperature=1.0,
                         max_new_tokens=2)
    per_prompt = [1.0, 0.5, 0.0, 0.5]  # the samples' mean reward of each prompt, by hand
    assert m["heldout_accuracy"] == pytest.approx(0.5)
    assert m["heldout_accuracy_se"] == pytest.approx(statistics.stdev(per_prompt) / math.sqrt(4))
    one = evaluate_heldout(_Policy(), _Engine(), examples[:1], _Pool(), samples_per_prompt=2, temperature=1.0,
                           max_new_tokens=2)
    assert math.isnan(one["heldout_accuracy_se"])  # one prompt: no spread to measure


def _lab_run(root: Path, records: list[dict]) -> Path:
    d = root / "e" / "a" / "seed0"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "e" / "a" / "seed0.yaml").write_text(yaml.safe_dump({"train": {"lr": 0.1}}))
    return d


def test_lab_compare_skips_a_key_the_archive_never_logged_but_not_one_the_rerun_lost(tmp_path):
    archived = [{"step": 0, "heldout_accuracy": 0.25}, {"step": 1, "ess": 0.9}]
    newer = [{"step": 0, "heldout_accuracy": 0.25, "heldout_accuracy_se": 0.05}, {"step": 1, "ess": 0.9}]
    c = compare_run(_lab_run(tmp_path / "archive", archived), _lab_run(tmp_path / "runs", newer))
    assert c.identical and c.values == 4  # step, heldout_accuracy; step, ess
    lost = [{"step": 0}, {"step": 1, "ess": 0.9}]
    c2 = compare_run(_lab_run(tmp_path / "archive2", archived), _lab_run(tmp_path / "runs2", lost))
    assert not c2.identical and c2.first == (0, "heldout_accuracy", 0.25, "<absent>")
