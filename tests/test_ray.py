"""Ray rollout actors (``orchestrator=ray``): real Ray, a local cluster on this machine, real actor processes.

Run with ``make test-ray`` (its own environment with ``trustbatch[ray]``). Without Ray the Ray tests are
skipped; the test that ``orchestrator=ray`` names the extra runs everywhere (it hides Ray if present).
"""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train

from runproc import alive, descendants, records, survivors
from tiny import TINY

SKIP_REASON = "Ray is not installed (pip install 'trustbatch[ray]'; `make test-ray` builds an env with it)"
SIGNAL = ["reward.name=scorers_for_tests:digit_fraction", "reward.workers=0", "threads=1"]
RAY = ["orchestrator=ray", "rollout.mode=async", "eval.every=100"]
TIMING = {"tokens_per_s", "rollout_s", "step_s", "learner_wait_s"}
ASYNC_ONLY = {"learner_wait_s", "max_staleness", "batches_dropped_stale", "worker_restarts"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    # Ray's worker processes inherit the environment of the raylet that ray.init starts: they import the scorer
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a new local cluster, whatever the shell says
    # a local cluster for one test needs no token; Ray would otherwise write one to ~/.ray and set
    # RAY_AUTH_MODE in this process's environment for the rest of the session
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


class _Watch:
    """Records every descendant of this process while a run goes on (Ray's gcs, raylet, workers, actors)."""

    def __init__(self):
        self.seen: dict[int, bytes] = {}  # pid -> its latest command line (Ray workers retitle themselves)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            for p in descendants(os.getpid()):
                self.seen[p] = _cmdline(p) or self.seen.get(p, b"")
            self.step()
            time.sleep(0.05)

    def step(self):
        pass

    def __enter__(self):
        self.before = {p for p in descendants(os.getpid()) if alive(p)}
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def survivors(self, grace_s: float = 15.0) -> list[tuple[int, bytes]]:
        """Descendants started during the run that are still alive after ``grace_s`` seconds."""
        started = sorted((self.seen.keys() | set(descendants(os.getpid()))) - self.before)
        return [(p, _cmdline(p)[:80]) for p in survivors(started, within=grace_s)]


def _assert_ray_gone(ray, watch: _Watch) -> None:
    assert not ray.is_initialized(), "the run left Ray initialised in the driver"
    assert any(b"raylet" in c for c in watch.seen.values()), "no raylet was seen: the run started no local cluster"
    left = watch.survivors()
    assert not left, f"processes outlived the run: {left}"


@pytest.mark.ray
def test_ray_actors_train_three_rounds_within_the_bound_and_shut_down(tmp_path, cache):
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    run, k = tmp_path / "run", 1
    with _Watch() as watch:
        train(load_config(None, TINY + SIGNAL + RAY + ["train.steps=3", f"run_dir={run}", "rollout.workers=2",
                                                       f"rollout.max_staleness={k}"]))
    recs = records(run)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for r in recs[1:]:
        assert r["policy_version"] - r["optimizer_steps"] - r["behaviour_version"] == r["staleness"]
        assert 0 <= r["staleness"] <= k, r
        assert r["worker_restarts"] == 0 and r["max_staleness"] == k
    # the actors loaded pushed weights: the last batch was sampled by a policy newer than the first
    assert recs[-1]["behaviour_version"] >= 1
    assert any(c.startswith(b"ray::RolloutWorker") for c in watch.seen.values()), "no Ray actor ran the rollouts"
    _assert_ray_gone(ray, watch)


@pytest.mark.ray
def test_ray_actors_at_k0_write_the_sync_metrics(tmp_path, cache):
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    base = TINY + SIGNAL + ["train.steps=3", "eval.every=100"]
    train(load_config(None, base + [f"run_dir={tmp_path / 'sync'}"]))
    with _Watch() as watch:
        train(load_config(None, base + RAY + [f"run_dir={tmp_path / 'ray'}", "rollout.max_staleness=0",
                                              "rollout.workers=2"]))
    sync, viaray = records(tmp_path / "sync"), records(tmp_path / "ray")
    assert [r["step"] for r in sync] == [r["step"] for r in viaray] == [0, 1, 2, 3]
    assert any(abs(r.get("loss", 0.0)) > 1e-6 for r in sync)  # the comparison covers real updates
    for a, b in zip(sync, viaray):  # weights through the object store, batches from actors: bit for bit
        assert {k: v for k, v in a.items() if k not in TIMING} == \
               {k: v for k, v in b.items() if k not in TIMING | ASYNC_ONLY}
    _assert_ray_gone(ray, watch)


@pytest.mark.ray
def test_a_killed_ray_actor_is_restarted_and_nothing_survives(tmp_path, cache):
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    run = tmp_path / "run"
    killed: list[int] = []

    class KillOne(_Watch):
        def step(self):  # SIGKILL one actor process once two rounds are logged
            metrics = run / "metrics.jsonl"
            if killed or not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
                return
            actors = [p for p in descendants(os.getpid()) if _cmdline(p).startswith(b"ray::RolloutWorker")]
            if actors:
                os.kill(actors[0], 9)
                killed.append(actors[0])

    with KillOne() as watch:
        train(load_config(None, TINY + SIGNAL + RAY + ["train.steps=8", f"run_dir={run}", "rollout.workers=2",
                                                       "rollout.max_staleness=1"]))
    assert killed, "the run ended before an actor could be killed"
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(9))
    assert recs[-1]["worker_restarts"] >= 1
    assert all(r["staleness"] <= 1 for r in recs[1:])
    _assert_ray_gone(ray, watch)


def test_orchestrator_ray_without_ray_names_the_extra(tmp_path, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, installed or not
    with pytest.raises(UserError) as e:
        train(load_config(None, TINY + SIGNAL + RAY + ["train.steps=1", f"run_dir={tmp_path / 'run'}"]))
    assert str(e.value) == "orchestrator=ray needs Ray, which is not installed: pip install 'trustbatch[ray]'"


def test_orchestrator_ray_needs_async_mode(tmp_path, cache):
    with pytest.raises(UserError, match="rollout.mode=async"):
        train(load_config(None, TINY + SIGNAL + ["orchestrator=ray", "train.steps=1", f"run_dir={tmp_path / 'run'}"]))
