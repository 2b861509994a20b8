"""``log.trackers`` (issue 37 item 1) without W&B or MLflow: the key, the refusal that names the extra, what
``MetricsLog`` hands a tracker, and TensorBoard's events read back with TensorBoard's own reader.

The W&B and MLflow runs themselves are tested in tests/integration/test_trackers.py (``make test-trackers``).
"""

from __future__ import annotations

import json
import math
import random
import sys

import numpy as np
import pytest

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train
from trustbatch.recipes.rundir import check_resume_changes
from trustbatch.trainer.runlog import MetricsLog
from trustbatch.trainer.trackers import open_trackers, require_trackers


def test_tensorboard_is_the_default_and_unknown_trackers_are_refused():
    assert load_config().log.trackers == ["tensorboard"]
    assert load_config(None, ["log.trackers=[]"]).log.trackers == []
    with pytest.raises(UserError, match="log.trackers"):
        load_config(None, ["log.trackers=[neptune]"])


def test_a_resume_may_add_a_tracker_but_not_move_the_store():
    saved = load_config().model_dump(mode="json")
    saved.pop("log")  # a run from before the key existed
    resumed = load_config(None, ["log.trackers=[tensorboard, wandb]"]).model_dump(mode="json")
    assert check_resume_changes(saved, resumed, defaults=load_config().model_dump(mode="json")) == ["log.trackers"]
    moved = load_config(None, ["log.mlflow_uri=sqlite:///other.db"]).model_dump(mode="json")
    with pytest.raises(UserError, match="log.mlflow_uri"):
        check_resume_changes(load_config().model_dump(mode="json"), moved)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_one_line_naming_the_extra_before_the_run_starts(name, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, name, None)  # find_spec then reports it missing, installed or not
    with pytest.raises(UserError) as e:
        require_trackers(["tensorboard", name])
    assert f"pip install 'trustbatch[{name}]'" in str(e.value) and "\n" not in str(e.value)
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=rf"trustbatch\[{name}\]"):
        train(load_config(None, [f"log.trackers=[{name}]", f"run_dir={run_dir}"]))
    assert not run_dir.exists()


class Recorder:
    """A tracker that records every call, in order."""

    def __init__(self, calls: list):
        self.calls = calls

    def log(self, metrics, step):
        random.random()  # a client drawing request ids from the global stream
        self.calls.append(("log", step, metrics))

    def log_artifact(self, path):
        self.calls.append(("artifact", path.name))

    def close(self, failed=False):
        self.calls.append(("close", failed))


def test_metrics_log_hands_trackers_the_finite_numbers_and_closes_them_once(tmp_path):
    calls = []
    log = MetricsLog(tmp_path, trackers=[Recorder(calls)])
    state = random.getstate()
    log.log(0, {"heldout_accuracy": 0.25, "heldout_pass@2": 1})
    log.log(1, {"reward_mean": 0.5, "ess": math.nan, "kl": math.inf, "skipped_step": True, "note": "x", "q": [1, 2]})
    assert random.getstate() == state  # the tracker's draws did not move the run's stream
    log.close(artifacts=(tmp_path / "plot.png",))
    log.close(failed=True)  # a second close (the error path after a finished summary) does nothing
    assert calls == [("log", 0, {"heldout_accuracy": 0.25, "heldout_pass@2": 1.0}),
                     ("log", 1, {"reward_mean": 0.5, "skipped_step": 1.0}),
                     ("artifact", "plot.png"), ("close", False)]
    # metrics.jsonl keeps every value, the ones no tracker plots included
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["note"] == "x" and math.isnan(lines[1]["ess"]) and lines[1]["q"] == [1, 2]


def test_a_rank_other_than_0_hands_its_trackers_nothing(tmp_path):
    calls = []
    log = MetricsLog(tmp_path, trackers=[Recorder(calls)], enabled=False)
    log.log(1, {"reward_mean": 0.5})
    log.close()
    assert calls == [] and not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_events_read_back_equal_the_logged_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = {0: {"heldout_accuracy": 0.125}, 1: {"reward_mean": 0.3, "ess": 0.9}, 2: {"reward_mean": 0.7}}
    log = MetricsLog(tmp_path, trackers=open_trackers(["tensorboard"], tmp_path, {}, resuming=False))
    for step, metrics in records.items():
        log.log(step, metrics)
    log.close()
    assert not (tmp_path / "trackers.json").exists()  # TensorBoard has no run id to keep
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    f32 = lambda x: float(np.float32(x))  # noqa: E731  TensorBoard stores float32
    assert got == {"heldout_accuracy": [(0, f32(0.125))], "reward_mean": [(1, f32(0.3)), (2, f32(0.7))],
                   "ess": [(1, f32(0.9))]}
