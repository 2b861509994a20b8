"""Packed lab records (issue 38, item 5): a run's files read the same from ``runs.tar.xz`` as from disk, and the
committed archive rebuilds the committed report."""

import json
import tarfile
from pathlib import Path

import pytest

from trustbatch.errors import UserError
from trustbatch.lab import records
from trustbatch.lab.archive import archive_runs

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE, REPORT = ROOT / "docs" / "lab2" / "archive", ROOT / "docs" / "lab2" / "report" / "README.md"


def _experiment(root: Path) -> Path:
    exp = root / "e"
    for arm, seed in (("a", 0), ("a", 1), ("b@x", 10)):
        run = exp / arm / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"wall_s": 1.5 + seed}))
        (run / "metrics.jsonl").write_text(f'{{"step": 0, "heldout_accuracy": 0.{seed + 1}}}\n{{"step": 1, "loss": -0.5}}\n{{"step": 2, "lo')
        (exp / arm / f"seed{seed}.yaml").write_text(f"train: {{seed: {seed}, lr: 3e-4}}\n")
    (exp / "a" / "seed2").mkdir()  # unfinished: no summary.json
    (exp / "a" / "seed2" / "metrics.jsonl").write_text('{"step": 0}\n')
    (exp / "experiment.yaml").write_text("arms: {a: {}, b@x: {}}\n")
    return exp


def test_packed_runs_read_as_the_files_they_came_from(tmp_path):
    plain = _experiment(tmp_path / "runs")
    archive_runs(tmp_path / "runs", tmp_path / "archive")
    packed = tmp_path / "archive" / "e"
    assert sorted(p.name for p in packed.iterdir()) == ["bases.json", "experiment.yaml", "runs.tar.xz"]
    # the order glob-then-sort gives (seed10 of b@x after a's seeds), unfinished runs left out
    assert [p.relative_to(packed).as_posix() for p in records.finished_runs(packed)] == ["a/seed0", "a/seed1", "b@x/seed10"]
    assert [p.relative_to(plain).as_posix() for p in records.finished_runs(plain)] == ["a/seed0", "a/seed1", "b@x/seed10"]
    assert [p.name for p in records.finished_runs(packed, "a")] == ["seed0", "seed1"]
    assert records.arm_names(packed) == ["a", "b@x"]
    run = packed / "a" / "seed1"
    # the torn last line is skipped, as the trainer's own reader skips it
    assert records.read_jsonl(run / "metrics.jsonl") == [{"step": 0, "heldout_accuracy": 0.2}, {"step": 1, "loss": -0.5}]
    assert json.loads(records.read_text(run / "summary.json")) == {"wall_s": 2.5}
    assert records.read_yaml(packed / "a" / "seed1.yaml") == {"train": {"seed": 1, "lr": 0.0003}}  # configs' 3e-4 float
    assert records.exists(run / "summary.json") and not records.exists(run / "steps.jsonl")
    with pytest.raises(FileNotFoundError, match="runs.tar.xz"):
        records.read_bytes(run / "steps.jsonl")
    (run / "summary.json").parent.mkdir(parents=True)
    (run / "summary.json").write_text('{"wall_s": 9}')  # a file on disk wins over the packed member
    assert json.loads(records.read_text(run / "summary.json")) == {"wall_s": 9}


def test_a_pack_rewritten_in_place_is_read_again(tmp_path):
    exp = tmp_path / "e"
    exp.mkdir()
    records.write_pack(exp / records.PACK, {"a/seed0/summary.json": b"1"})
    assert records.read_text(exp / "a" / "seed0" / "summary.json") == "1"
    records.write_pack(exp / records.PACK, {"a/seed0/summary.json": b"22", "a/seed1/summary.json": b"3"})
    assert records.read_text(exp / "a" / "seed0" / "summary.json") == "22" and len(records.finished_runs(exp)) == 2
    with tarfile.open(exp / records.PACK) as tar:  # an ordinary tar.xz: `tar -xJf` opens it too
        assert [m.name for m in tar.getmembers()] == ["a/seed0/summary.json", "a/seed1/summary.json"]


def test_a_trace_two_experiments_share_is_packed_once_and_survives_its_holder_being_replaced(tmp_path):
    runs = tmp_path / "runs"
    ref = _experiment(runs).rename(runs / "reference")
    (ref / "a" / "seed0.yaml").write_text(f"run_dir: {ref / 'a' / 'seed0'}\n")  # trained in reference
    shift = runs / "shift"
    (shift / "p3o").mkdir(parents=True)
    (shift / "experiment.yaml").write_text("arms: {onpolicy: {}, p3o: {}}\n")
    (shift / "onpolicy").symlink_to(ref / "a")  # the shared on-policy reference, as lab run links it
    (shift / "p3o" / "seed0").mkdir()
    (shift / "p3o" / "seed0" / "summary.json").write_text("{}")
    (shift / "p3o" / "seed0" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    out = tmp_path / "archive"
    archive_runs(runs, out)
    shift_links = records.links(out / "shift" / records.PACK)
    metrics = (ref / "a" / "seed0" / "metrics.jsonl").read_bytes()
    # held by reference, where the run was trained (its config says so), linked from shift; configs stay packed
    assert shift_links["onpolicy/seed0/metrics.jsonl"][0] == "reference/a/seed0/metrics.jsonl"
    assert set(shift_links) == {"onpolicy/seed0/metrics.jsonl", "onpolicy/seed1/metrics.jsonl"}
    assert "onpolicy/seed0/summary.json" in records.packed(out / "shift" / records.PACK)
    assert records.read_bytes(out / "shift" / "onpolicy" / "seed0" / "metrics.jsonl") == metrics
    assert [p.name for p in records.finished_runs(out / "shift", "onpolicy")] == ["seed0", "seed1"]
    # reference re-archived from other runs: shift first takes its own copy, so it keeps the records it had
    (ref / "a" / "seed0" / "metrics.jsonl").write_text('{"step": 0, "heldout_accuracy": 0.5}\n')
    (shift / "onpolicy").unlink()
    (shift / "onpolicy").mkdir()  # shift's runs are gone; only its archive holds them now
    archive_runs(runs, out, ["reference"])
    assert records.read_bytes(out / "shift" / "onpolicy" / "seed0" / "metrics.jsonl") == metrics
    assert "onpolicy/seed0/metrics.jsonl" in records.packed(out / "shift" / records.PACK)
    # a link whose holder changed behind the archive's back is an error naming what to re-archive
    linked = {"onpolicy/seed1/metrics.jsonl": ["reference/a/seed1/metrics.jsonl", "0" * 64]}
    records.write_pack(out / "shift" / records.PACK, {"onpolicy/seed1/summary.json": b"{}"}, linked)
    with pytest.raises(UserError, match="holds other bytes now; archive shift again"):
        records.read_bytes(out / "shift" / "onpolicy" / "seed1" / "metrics.jsonl")


def _body(text: str) -> list[str]:
    # the "Generated <time> ... at commit <c>" line is the one line a rebuild changes by design
    return [line for line in text.splitlines() if not line.startswith("Generated ")]


COMMITTED_REPORTS = sorted(ROOT.glob("docs/lab*/report/README.md"))


def test_every_lab_with_an_archive_has_its_committed_report_checked():
    archives = sorted(p.parent for p in ROOT.glob("docs/lab*/archive"))
    assert archives and [r.parent.parent for r in COMMITTED_REPORTS] == archives  # a report per archive, no other


@pytest.mark.parametrize("report", COMMITTED_REPORTS, ids=lambda p: p.parts[-3])
def test_the_committed_archive_rebuilds_the_committed_report(report, tmp_path):
    """Every line of each committed docs/lab*/report/README.md but its 'Generated' stamp (header, settings, rule
    labels, verdicts, tables, costs, re-run checks, figure links), from the packed archive beside it. A report with
    figures is rebuilt with their links but without drawing them (the slow test below draws them); a text-only one
    says so in its stamp (``lab report --text-only``), which is how it was written."""
    from trustbatch.lab.report import write_report

    committed = report.read_text()
    stamp = next(line for line in committed.splitlines() if line.startswith("Generated "))
    text_only = "![" not in committed
    assert ("--text-only" in stamp) == text_only, "a committed report is written by `lab report`, never trimmed by hand"
    got = write_report(report.parent.parent / "archive", tmp_path / "report", figures="none" if text_only else "link").read_text()
    assert _body(got) == _body(committed)
    assert not list((tmp_path / "report").glob("*.png"))


@pytest.mark.slow
def test_lab_report_cli_over_the_archive_rebuilds_the_report_and_its_figures(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trustbatch.cli import app

    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, ["lab", "report", "--runs", "docs/lab2/archive", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    got = (tmp_path / "README.md").read_text()
    assert _body(got) == _body(REPORT.read_text())
    linked = [line.split("](")[1].rstrip(")") for line in got.splitlines() if line.startswith("![")]
    assert linked and all((tmp_path / f).stat().st_size > 1000 for f in linked)


def test_lab_records_fit_the_budget():
    """Issue 47 item 5 (issue 38 set 10 MB): everything under docs/lab* stays under 12 MB in the work tree (it ships
    to machines with a size cap)."""
    total = sum(p.stat().st_size for d in ROOT.glob("docs/lab*") for p in d.rglob("*") if p.is_file())
    assert total < 12e6, f"docs/lab* holds {total / 1e6:.1f} MB; pack run records (`trustbatch lab archive`)"


def test_lab_report_text_only_writes_the_committed_form(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trustbatch.cli import app

    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, ["lab", "report", "--runs", "docs/lab3/archive", "--out", str(tmp_path), "--text-only"])
    assert res.exit_code == 0, res.output
    got = (tmp_path / "README.md").read_text()
    assert f"--out {tmp_path} --text-only`." in got.splitlines()[2] and not list(tmp_path.glob("*.png"))
    assert _body(got) == _body((ROOT / "docs" / "lab3" / "report" / "README.md").read_text())
