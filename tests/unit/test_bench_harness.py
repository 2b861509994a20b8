"""bench/harness.py: the order arms run in, what a warm-up discards, and the JSON lines a benchmark records."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import harness  # noqa: E402


def _arms(calls: list[str]):
    def arm(name, value):
        def fn():
            calls.append(name)
            return value
        return fn
    return {"a": arm("a", 1.0), "b": arm("b", 2.0), "c": arm("c", None)}


def test_round_robin_after_warmup_keeps_only_the_measured_rounds():
    calls = []
    out = harness.interleave(_arms(calls), repeats=2, warmup=1)
    assert calls == ["a", "b", "c"] * 3
    assert out["a"] == [1.0, 1.0] and out["b"] == [2.0, 2.0]
    assert len(out["c"]) == 2 and all(0 <= s < 1 for s in out["c"])  # None: timed by the harness, wall seconds


def test_rotate_starts_each_round_at_the_next_arm_counting_warmup_rounds():
    calls = []
    harness.interleave(_arms(calls), repeats=3, warmup=1, rotate=True)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_record_summarises_number_lists_and_appends_one_line_per_arm(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    harness.record("demo", {"x": {"s": [3.0, 1.0, 2.0], "note": "kept"}, "y": {"s": [5]}}, extra={"B": 4})
    harness.record("demo", {"x": {"s": [7.0]}})
    lines = [json.loads(x) for x in (tmp_path / "results" / "demo.jsonl").read_text().splitlines()]
    assert [x["arm"] for x in lines] == ["x", "y", "x"]
    assert lines[0]["s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3} and lines[0]["note"] == "kept"
    assert lines[1]["s"] == {"median": 5, "min": 5, "max": 5, "n": 1} and lines[0]["B"] == 4
    assert {"date", "commit", "machine", "load_1min", "load_1min_start"} <= set(lines[0])
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == lines


def test_no_save_prints_without_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    a = harness.options(argparse.ArgumentParser()).parse_args(["--no-save"])
    harness.record("demo", {"x": {"s": [1.0]}}, save=not a.no_save)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("values, median", [([4.0, 1.0, 3.0, 2.0], 2.5), ([9.0], 9.0)])
def test_summary_median_of_even_and_odd_samples(values, median):
    assert harness.summary(values) == {"median": median, "min": min(values), "max": max(values), "n": len(values)}
