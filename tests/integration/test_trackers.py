"""Weights & Biases and MLflow as trackers (issue 37 item 1): a real tiny run and a ``--resume`` of it, read back
through each package's own reader, against ``metrics.jsonl`` and (issue 45 item 5) ``samples.jsonl``; and (issue 46
item 1) a run killed with SIGKILL, or stopped, after its last checkpoint and resumed: every tracker then holds each
round of ``metrics.jsonl`` and its sample completions once.

W&B runs offline; its ``.wandb`` transaction logs are read with ``wandb leet inspect --json`` (W&B's own reader of
its own format). MLflow writes to a temporary SQLite store, read with ``MlflowClient``. Run with
``make test-trackers`` (its own environment with ``trustbatch[wandb,mlflow]``); without the packages these skip.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train
from trustbatch.trainer.runlog import MetricsLog
from trustbatch.trainer.trackers import open_trackers

from runproc import TIMING, cache, records  # noqa: F401
from tiny import TINY

SKIP = "needs trustbatch[wandb,mlflow] (`make test-trackers` builds an environment with them)"
RUN = TINY + ["threads=1", "reward.workers=0"]
# training-rollout samples every round (3 of the 16 rows), held-out ones (2) at each evaluation (eval.every=2)
SAMPLES = ["log.samples.every=1", "log.samples.train=3", "log.samples.heldout=2"]
pytestmark = pytest.mark.trackers


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, cache):
    """A tiny run of 2 rounds with every tracker, then ``--resume`` to 4; W&B offline and MLflow on SQLite, all
    in a temporary folder (W&B's staging and config folders included, so nothing lands in the home folder)."""
    pytest.importorskip("wandb", reason=SKIP)
    pytest.importorskip("mlflow", reason=SKIP)
    tmp = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(var, raising=False)
        for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
            mp.setenv(var, str(tmp / var.lower()))
        mp.chdir(tmp)  # MLflow's default artifact location is ./mlruns
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        run_dir = tmp / "tracked"
        train(load_config(None, RUN + ["train.steps=2", f"run_dir={run_dir}", f"log.mlflow_uri={uri}",
                                       "log.trackers=[tensorboard, wandb, mlflow]", *SAMPLES]))
        first_ids = json.loads((run_dir / "trackers.json").read_text())
        train(resume=str(run_dir), overrides=["train.steps=4"])
    return run_dir, uri, first_ids


def _expected(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's finite numbers by round: what every tracker must hold."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
            for r in map(json.loads, lines)}


def _wandb_records(run_file: Path) -> list[dict]:
    out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", str(run_file), "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _b64md5(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def test_wandb_offline_run_holds_every_round_and_the_resume_appends_to_it(tracked):
    run_dir, _, first_ids = tracked
    run_files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2  # one per process: the first segment and the resume
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["wandb"] == first_ids["wandb"]
    config = {}
    for run_file in run_files:
        recs = _wandb_records(run_file)
        run = next(r["run"] for r in recs if r["type"] == "run")
        assert run["run_id"] == ids["wandb"] and run["display_name"] == run_dir.name and run["project"] == "trustbatch"
        for r in recs:
            if r["type"] == "config":
                config.update(r["config"]["update"])
        assert [r["exit"]["exit_code"] for r in recs if r["type"] == "exit"] == [0]
        artifacts = [r["artifact"] for r in recs if r["type"] == "artifact" and r["artifact"]["type"] == "run-output"]
        assert [c["path"] for a in artifacts for c in a["manifest"]["contents"]] == ["plot.png"]
    history = dict(_wandb_history(run_dir)[0])
    expected = _expected(run_dir)
    assert sorted(history) == [0, 1, 2, 3, 4] == sorted(expected)
    for step, metrics in expected.items():
        assert history[step] == metrics, step
    # the resume's plot, the final one, is the last artifact logged; the config holds the resumed value
    assert artifacts[0]["manifest"]["contents"][0]["digest"] == _b64md5(run_dir / "plot.png")
    assert config["train"]["steps"] == 4 and config["run_dir"] == str(run_dir)


def test_mlflow_run_holds_every_round_and_the_resume_appends_to_it(tracked, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir, uri, first_ids = tracked
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert run_id == first_ids["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume opened no second run
    expected = _expected(run_dir)
    keys = {k for m in expected.values() for k in m}
    assert "heldout_pass@2" in keys  # MLflow refuses '@' in a name: logged as pass_at_k
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key.replace("@", "_at_")))
        assert history == sorted((s, m[key]) for s, m in expected.items() if key in m), key
    # parameters are the first segment's (MLflow's cannot change); config.json is the resumed config
    assert run.data.params["train.steps"] == "2" and run.data.params["objective.name"] == "p3o"
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert config["train"]["steps"] == 4
    plot = Path(client.download_artifacts(run_id, "plot.png", str(tmp_path)))
    assert plot.read_bytes() == (run_dir / "plot.png").read_bytes()


def test_samples_hold_the_rounds_rollouts_with_their_reward_and_reference_once_in_every_tracker(tracked):
    """Issue 45 item 5: log.samples writes, for each round, 3 of the round's training rollouts and, at each
    evaluation, 2 held-out ones, each with its round (never "step"), reward, reference answer and behaviour log-prob
    sum; checked against the task's examples and the task's own scorer (which rows, and the log-prob sums, against
    rollouts made by hand: tests/unit/test_samples.py). The trackers hold the same rows (W&B's tables, MLflow's
    artifacts, TensorBoard's text), each (round, split) once, across the resume."""
    import reasoning_gym

    from trustbatch.recipes import prepare_run

    run_dir, uri, _ = tracked
    rows = _samples(run_dir)
    assert sorted(rows) == sorted([(r, "train") for r in (1, 2, 3, 4)] + [(r, "heldout") for r in (0, 2, 4)])
    assert all(len(v) == (3 if split == "train" else 2) for (_, split), v in rows.items())
    task, _, pool, _ = prepare_run(load_config(None, RUN))
    pool.close()
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    references = {e.prompt: e.reference for e in task.train + task.heldout}
    for group in rows.values():
        for row in group:
            assert set(row) == {"round", "split", "prompt", "completion", "reward", "reference",
                                "behaviour_logprob_sum"}
            assert row["reference"] == references[row["prompt"]]
            assert row["reward"] == score(row["completion"].strip(), json.loads(row["reference"]))
            assert -math.inf < row["behaviour_logprob_sum"] < 0
    assert all([r["prompt"] for r in rows[k, "heldout"]] == [e.prompt for e in task.heldout[:2]] for k in (0, 2, 4))
    _assert_every_tracker_holds_the_samples_once(run_dir, uri)


def test_trackers_do_not_move_the_run(tracked, tmp_path):
    """The same 4 rounds without any tracker, uninterrupted: the tracked and resumed run's records are equal."""
    run_dir = tracked[0]
    plain = tmp_path / "plain"
    train(load_config(None, RUN + ["train.steps=4", f"run_dir={plain}", "log.trackers=[]"]))
    assert not (plain / "tensorboard").exists() and not (plain / "trackers.json").exists()
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(records(run_dir)) == strip(records(plain))


def test_mlflow_failed_segment_then_resume_and_a_stored_run_the_store_lacks(tracked, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = tracked[1]  # a store whose tables exist already
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "segments")
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    run_dir = tmp_path / "segments"
    run_dir.mkdir()
    log = MetricsLog(run_dir, open_trackers(["mlflow"], run_dir, {"a": 1}, resuming=False, mlflow_uri=uri))
    log.log(1, {"x": 1.0})
    log.close(failed=True)  # Ctrl-C, a crash
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert client.get_run(run_id).info.status == "FAILED"
    log = MetricsLog(run_dir, open_trackers(["mlflow"], run_dir, {"a": 1}, resuming=True, mlflow_uri=uri))
    assert client.get_run(run_id).info.status == "RUNNING"
    log.log(2, {"x": 2.0})
    log.close()
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "x")] == [(1, 1.0), (2, 2.0)]
    # trackers.json names a run this store does not hold (another store, a deleted run): a new run, with a warning
    (run_dir / "trackers.json").write_text(json.dumps({"mlflow": "0" * 32}))
    with pytest.warns(UserWarning, match="not in the tracking store"):
        log = MetricsLog(run_dir, open_trackers(["mlflow"], run_dir, {"a": 1}, resuming=True, mlflow_uri=uri))
    log.close()
    new_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert new_id != "0" * 32 and client.get_run(new_id).info.status == "FINISHED"


def test_a_bad_store_or_a_missing_key_is_one_line_before_the_run_starts(tmp_path):
    """Issue 46 item 2: an MLflow store that cannot be written (inside a file, a folder /proc refuses), a scheme
    MLflow does not know, W&B online with no API key: each `trustbatch train` exits 2 with one line naming it, and
    leaves no run directory (the check comes before it, and before any model loads). The four run at once."""
    pytest.importorskip("wandb", reason=SKIP)
    pytest.importorskip("mlflow", reason=SKIP)
    from runproc import one_line

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))  # no stored login
    cases = {  # name -> (extra overrides, extra environment, what the line says)
        "inside_a_file": ([f"log.mlflow_uri=sqlite:///{afile}/mlflow.db"], {}, f"sqlite:///{afile}/mlflow.db"),
        "proc": (["log.mlflow_uri=sqlite:////proc/1/no/mlflow.db"], {}, "sqlite:////proc/1/no/mlflow.db"),
        "scheme": (["log.mlflow_uri=nosuch://host/x"], {}, "nosuch://host/x"),
        "wandb_online": (["log.trackers=[wandb]"], {"WANDB_MODE": "online"}, "WANDB_MODE=online"),
    }
    procs = {}
    for name, (extra, more_env, _) in cases.items():
        trackers = [] if any(e.startswith("log.trackers") for e in extra) else ["log.trackers=[mlflow]"]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "trustbatch", "train", *RUN, f"run_dir={tmp_path / name}", *trackers, *extra],
            cwd=tmp_path, env={**env, **more_env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    for name, (_, _, says) in cases.items():
        _, err = procs[name].communicate(timeout=300)
        line = one_line(err)
        assert procs[name].returncode == 2 and says in line, err
        assert not (tmp_path / name).exists(), name
    assert afile.read_text() == "not a folder"


def test_wandb_online_needs_a_stored_or_given_key_and_offline_needs_none(tmp_path, monkeypatch):
    """The login check of issue 46 item 2 against W&B's own lookup: a netrc entry for the host counts as a login, an
    absent one does not, a key of the wrong form is refused as wandb.init refuses it; offline needs none."""
    pytest.importorskip("wandb", reason=SKIP)
    from trustbatch.trainer.trackers.wandb import check_login

    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # no terminal to ask at
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_login()
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(UserError, match="no W&B API key is configured"):
        check_login()
    import wandb

    host = wandb.Settings().base_url.split("://")[1].rstrip("/")
    (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password {'a' * 40}\n")
    check_login()
    (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password abc\n")
    with pytest.raises(UserError, match="40"):  # W&B's own words on the key's form
        check_login()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a key in the environment: W&B's to check at init
    (tmp_path / "netrc").unlink()
    check_login()


def test_mlflow_default_store_is_beside_the_run_directory_not_in_the_working_directory(tmp_path, monkeypatch):
    """Neither log.mlflow_uri nor MLFLOW_TRACKING_URI: the store is RUNS/mlflow.db and the artifacts RUNS/mlruns,
    RUNS being the folder that holds the run directory (runs/ by default); the working directory stays empty."""
    pytest.importorskip("mlflow", reason=SKIP)
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "beside")
    cwd, runs = tmp_path / "cwd", tmp_path / "runs"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run_dir = runs / "one"
    # the check at start opens the store the run will open (it opened MLflow's default, ./mlflow.db, and left it)
    from trustbatch.trainer.trackers import check_trackers

    (tmp_path / "elsewhere" / "mlflow.db").mkdir(parents=True)  # a store that cannot be opened: a folder
    with pytest.raises(UserError, match=r"tracking store 'sqlite:///.*elsewhere/mlflow.db'.* cannot be used"):
        check_trackers(["mlflow"], None, tmp_path / "elsewhere" / "run")
    check_trackers(["mlflow"], None, run_dir)
    assert list(cwd.iterdir()) == [] and (runs / "mlflow.db").is_file()
    run_dir.mkdir(parents=True)
    (run_dir / "plot.png").write_bytes(b"a plot")
    log = MetricsLog(run_dir, open_trackers(["mlflow"], run_dir, {"a": 1}, resuming=False))
    log.log(1, {"x": 1.0})
    log.close(artifacts=(run_dir / "plot.png",))
    assert list(cwd.iterdir()) == []
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "x")] == [(1, 1.0)]
    stored = [p for p in (runs / "mlruns").rglob("plot.png")]
    assert len(stored) == 1 and stored[0].read_bytes() == b"a plot"



KILL_STEPS, KILL_EVERY = 8, 4  # checkpoints at rounds 0, 4 and 8


def _tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's own reading of RUN_DIR/tensorboard: every event file, purges applied, as the UI shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _wandb_history(run_dir: Path) -> tuple[list[tuple[int, dict]], list[tuple[int, str, list[dict]]]]:
    """The history rows of the W&B run folders `wandb sync RUN_DIR/wandb/offline-run-*` would upload, in order:
    (round, the row's metrics) for the rounds' metrics, and (round, split, its rows) for the sample tables, each
    read from the table file W&B stored in the folder."""
    metrics, tables = [], []
    for run_file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in _wandb_records(run_file):
            if r["type"] == "history":
                item = {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
                round_ = item.pop("round")
                paths = {k[:-len(".path")]: v for k, v in item.items() if k.endswith(".path")}
                if not paths:
                    metrics.append((round_, item))
                for key, path in paths.items():  # samples/train, samples/heldout
                    stored = json.loads((run_file.parent / "files" / path).read_text())
                    tables.append((round_, key.split("/")[1], [dict(zip(stored["columns"], row))
                                                               for row in stored["data"]]))
    return metrics, tables


def _offline_wandb_and_mlflow_env(monkeypatch, tmp: Path, mode: str | None) -> None:
    """W&B offline with its folders in ``tmp``, its own service (not one an earlier test's run left in this process:
    a killed trainer must take its service with it), and MLflow's store where the run directory puts it.
    ``mode``: ``WANDB_MODE`` (None: unset, the tracker then asks for offline itself; a run in this process must leave
    it so, W&B reads the environment once per process)."""
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_SERVICE", "WANDB_MODE", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    if mode:
        monkeypatch.setenv("WANDB_MODE", mode)
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp / var.lower()))


def _assert_every_tracker_holds_the_record_once(run_dir: Path, mlflow_uri: str) -> None:
    """TensorBoard, MLflow and W&B (offline), each read back through its own reader, hold every round of
    metrics.jsonl exactly once, with its values (TensorBoard's as float32, the others' exactly)."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    expected = _expected(run_dir)
    keys = {k for m in expected.values() for k in m}
    f32 = lambda x: float(np.float32(x))  # noqa: E731  TensorBoard stores float32
    scalars = _tensorboard_scalars(run_dir)
    assert set(scalars) == keys
    for key in keys:
        assert scalars[key] == [(s, f32(m[key])) for s, m in sorted(expected.items()) if key in m], key

    client = MlflowClient(tracking_uri=mlflow_uri)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key.replace("@", "_at_")))
        assert history == [(s, m[key]) for s, m in sorted(expected.items()) if key in m], key

    history = _wandb_history(run_dir)[0]
    assert sorted(r for r, _ in history) == sorted(expected), [r for r, _ in history]
    for round_, item in history:
        assert item == expected[round_], round_
    _assert_every_tracker_holds_the_samples_once(run_dir, mlflow_uri)


def _samples(run_dir: Path) -> dict[tuple[int, str], list[dict]]:
    """samples.jsonl's lines by (round, split)."""
    out: dict[tuple[int, str], list[dict]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault((row["round"], row["split"]), []).append(row)
    return out


def _assert_every_tracker_holds_the_samples_once(run_dir: Path, mlflow_uri: str) -> None:
    """Each (round, split) of samples.jsonl once in each tracker, read back through its own reader: W&B's table
    (the table file in its run folder), MLflow's JSON artifact (downloaded with the client), TensorBoard's text
    (tag samples/SPLIT, through the plugin event accumulator TensorBoard's server reads it with)."""
    from mlflow.tracking import MlflowClient
    # the loader TensorBoard's text tab reads through (the legacy EventAccumulator applies no purge to tensors)
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    expected = _samples(run_dir)
    tables = _wandb_history(run_dir)[1]
    assert sorted((r, s) for r, s, _ in tables) == sorted(expected)
    for round_, split, rows in tables:
        assert rows == expected[round_, split], (round_, split)

    client = MlflowClient(tracking_uri=mlflow_uri)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    stored = {}
    for split in {s for _, s in expected}:
        for f in client.list_artifacts(run_id, f"samples/{split}"):
            round_ = int(f.path.rsplit("round_", 1)[1].removesuffix(".json"))
            stored[round_, split] = json.loads(Path(client.download_artifacts(run_id, f.path, str(run_dir.parent)))
                                               .read_text())
    assert stored == expected

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for split in {s for _, s in expected}:
        texts = events.Tensors(f"samples/{split}/text_summary")
        assert [t.step for t in texts] == sorted(r for r, s in expected if s == split), split
        for t in texts:
            text = t.tensor_proto.string_val[0].decode()
            assert all(row["prompt"] + row["completion"] in text for row in expected[t.step, split])


def test_a_kill9_and_resume_leave_every_tracker_holding_each_round_of_metrics_jsonl_once(tmp_path, cache, monkeypatch):
    """Issue 46 item 1: `trustbatch train` with TensorBoard, W&B (offline) and MLflow, killed with SIGKILL at a round
    drawn by a seeded random choice (W&B's service dies before it writes its buffer; MLflow and TensorBoard hold the
    rounds past the last checkpoint, which the resume redoes), then `--resume`d to the end. Each tracker, read back
    through its own reader, holds every round of metrics.jsonl exactly once, with metrics.jsonl's values."""
    pytest.importorskip("wandb", reason=SKIP)
    pytest.importorskip("mlflow", reason=SKIP)
    pytest.importorskip("tensorboard", reason=SKIP)
    import random

    from runproc import kill_at_round, outlived, resume_args, run, start, train_args

    _offline_wandb_and_mlflow_env(monkeypatch, tmp_path, "offline")
    run_dir = tmp_path / "runs" / "killed"  # MLflow's store: tmp_path/runs/mlflow.db, beside the run directory
    # the last round every tracker was sent before the kill (it comes once the next round is in metrics.jsonl): past
    # the round-4 checkpoint, so the resume keeps rounds 0-4 (which W&B's killed segment never wrote) and redoes the
    # rounds after it (which TensorBoard and MLflow hold already)
    kill_after = random.Random(46).randint(KILL_EVERY + 1, KILL_STEPS - 2)
    args = ["reward.workers=0", f"train.steps={KILL_STEPS}", f"checkpoint_every={KILL_EVERY}",
            "log.trackers=[tensorboard, wandb, mlflow]", *SAMPLES]
    kids = kill_at_round(start(train_args(run_dir, *args), tmp_path / "killed.log"), run_dir, kill_after + 1)
    assert not outlived(kids), "a process of the killed run (W&B's service) outlived it"
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = run(resume_args(run_dir), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed_from = json.loads((run_dir / "segments.jsonl").read_text().splitlines()[-1])["start_round"]
    assert resumed_from < kill_after < logged[-1], (resumed_from, logged)  # the resume redid rounds trackers held
    assert sorted(_expected(run_dir)) == list(range(KILL_STEPS + 1))
    _assert_every_tracker_holds_the_record_once(run_dir, f"sqlite:///{run_dir.parent / 'mlflow.db'}")


def test_a_stopped_run_resumed_before_its_last_rounds_and_a_tracker_added_keep_each_round_once(tmp_path, monkeypatch):
    """A Ctrl-C: every tracker is closed, W&B's folder holding every round it was sent, rounds 3 and 4 among them,
    which the resume from the round-2 checkpoint redoes (with other values here); MLflow's run then holds them too
    and is replaced, TensorBoard (added on the resume) is sent every earlier round. Each holds metrics.jsonl once."""
    pytest.importorskip("wandb", reason=SKIP)
    pytest.importorskip("mlflow", reason=SKIP)
    from mlflow.tracking import MlflowClient

    _offline_wandb_and_mlflow_env(monkeypatch, tmp_path, None)
    monkeypatch.chdir(tmp_path)
    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "stopped"
    run_dir.mkdir()
    log = MetricsLog.open(run_dir, ["wandb", "mlflow"], {"a": 1}, resume_round=None, mlflow_uri=uri)
    row = {"prompt": "p", "completion": "c", "reward": 1.0, "reference": "r", "behaviour_logprob_sum": -0.5}
    for r in range(5):
        log.log_samples(r, "train", [{**row, "completion": f"c{r}"}])
        log.log(r, {"x": float(r), "y": 10.0 * r})
    log.close(failed=True)
    first = json.loads((run_dir / "trackers.json").read_text())
    log = MetricsLog.open(run_dir, ["tensorboard", "wandb", "mlflow"], {"a": 2}, resume_round=2, mlflow_uri=uri)
    for r in range(3, 6):
        log.log_samples(r, "train", [{**row, "completion": f"redone {r}"}])
        log.log(r, {"x": r + 0.5})
    log.close()
    assert sorted(_expected(run_dir)) == [0, 1, 2, 3, 4, 5] and _expected(run_dir)[4] == {"x": 4.5}
    assert _samples(run_dir)[4, "train"][0]["completion"] == "redone 4"
    _assert_every_tracker_holds_the_record_once(run_dir, uri)
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["wandb"] == first["wandb"]  # the same W&B run, its stopped folder set aside
    assert [p.parent.name for p in (run_dir / "wandb-superseded").glob("*/run-*.wandb")] != []
    client = MlflowClient(tracking_uri=uri)
    old, new = client.get_run(first["mlflow"]), client.get_run(ids["mlflow"])
    assert new.info.run_id != old.info.run_id and old.info.lifecycle_stage == "deleted"
    assert new.data.tags["trustbatch.replaces"] == old.info.run_id and new.data.params == old.data.params == {"a": "1"}
    assert new.info.run_name == old.info.run_name == run_dir.name


def _mlflow_rounds(uri: str, run_dir: Path, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def _mlflow_sample_rounds(uri: str, run_dir: Path, split: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return sorted(int(f.path.rsplit("round_", 1)[1].removesuffix(".json"))
                  for f in MlflowClient(tracking_uri=uri).list_artifacts(run_id, f"samples/{split}"))


def test_a_ctrl_c_while_a_resume_starts_its_trackers_keeps_the_redone_rounds_out_of_mlflow(tmp_path, monkeypatch):
    """A resume cut metrics.jsonl back to the checkpoint and marked MLflow's run stale in memory only; a Ctrl-C while
    the trackers started (W&B's init takes seconds) lost the mark, and the next resume appended the redone rounds to
    the run that held them: rounds 3 and 4 twice."""
    pytest.importorskip("mlflow", reason=SKIP)
    from trustbatch.trainer import runlog

    _offline_wandb_and_mlflow_env(monkeypatch, tmp_path, None)
    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    run_dir.mkdir()
    log = MetricsLog.open(run_dir, ["mlflow"], {"a": 1}, resume_round=None, mlflow_uri=uri)
    for r in range(5):
        log.log(r, {"x": float(r)})
        if r == 2:
            log.checkpointed(2)
    # killed after round 4 (no close): tracked.json says MLflow holds rounds up to 2, and was open
    real = runlog.open_trackers

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runlog, "open_trackers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog.open(run_dir, ["mlflow"], {"a": 1}, resume_round=2, mlflow_uri=uri)
    monkeypatch.setattr(runlog, "open_trackers", real)
    log = MetricsLog.open(run_dir, ["mlflow"], {"a": 1}, resume_round=2, mlflow_uri=uri)
    for r in (3, 4, 5):
        log.log(r, {"x": r + 0.5})
    log.close()
    assert _mlflow_rounds(uri, run_dir, "x") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5), (5, 5.5)]


def test_samples_sent_before_a_rounds_metrics_line_are_redone_once_in_mlflow(tmp_path, monkeypatch):
    """A round's samples reach the trackers before its metrics line: a kill between the two left round 3's samples in
    MLflow while metrics.jsonl ended at round 2, and the resume (which looked at metrics.jsonl alone) kept that run,
    so MLflow held samples of a round samples.jsonl never got (the resume samples every other round here)."""
    pytest.importorskip("mlflow", reason=SKIP)

    _offline_wandb_and_mlflow_env(monkeypatch, tmp_path, None)
    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    run_dir.mkdir()
    row = {"prompt": "p", "completion": "c", "reward": 1.0, "reference": "r", "behaviour_logprob_sum": -0.5}
    log = MetricsLog.open(run_dir, ["mlflow"], {"a": 1}, resume_round=None, mlflow_uri=uri)
    for r in range(4):
        log.log_samples(r, "train", [row])
        if r < 3:  # killed after round 3's samples, before its metrics line
            log.log(r, {"x": float(r)})
    log.checkpointed(2)
    log = MetricsLog.open(run_dir, ["mlflow"], {"a": 1}, resume_round=2, mlflow_uri=uri)
    log.log(3, {"x": 3.5})  # round 3 redone without samples
    log.log_samples(4, "train", [row])
    log.log(4, {"x": 4.5})
    log.close()
    assert sorted({json.loads(line)["round"] for line in (run_dir / "samples.jsonl").read_text().splitlines()}) \
        == _mlflow_sample_rounds(uri, run_dir, "train") == [0, 1, 2, 4]
    assert _mlflow_rounds(uri, run_dir, "x") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]


def test_what_a_reward_function_logs_reaches_every_tracker(tmp_path, cache, monkeypatch, support_on_pythonpath):
    """TRL's log_metric and log_extra from a reward function (``rewards.trl_kwargs``): the round's
    ``reward_metrics/NAME`` and the samples' extra column reach each tracker as metrics.jsonl and samples.jsonl hold
    them (W&B's table takes its columns from the first row: every row has the column)."""
    pytest.importorskip("wandb", reason=SKIP)
    pytest.importorskip("mlflow", reason=SKIP)
    _offline_wandb_and_mlflow_env(monkeypatch, tmp_path, None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCORER_CALLS", str(tmp_path / "calls.jsonl"))
    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "logged"
    train(load_config(None, RUN + ["train.steps=2", f"run_dir={run_dir}", f"log.mlflow_uri={uri}",
                                   "log.trackers=[tensorboard, wandb, mlflow]", *SAMPLES,
                                   "reward.functions=[{name: scorers_for_tests:trl_state_and_logs}]"]))
    assert all("reward_metrics/mean_len" in m for s, m in _expected(run_dir).items() if s > 0)
    rows = [row for group in _samples(run_dir).values() for row in group]
    # held-out evaluation keeps the task's scorer (eval.reward=data): its rows have no such column
    assert {(r["split"], r.get("length") == len(r["completion"])) for r in rows} == {("train", True),
                                                                                     ("heldout", False)}
    _assert_every_tracker_holds_the_record_once(run_dir, uri)
