"""Ray rollout actors and learner ranks (``orchestrator=ray``): real Ray, a local cluster on this machine, real
actor processes.

Run with ``make test-ray`` (its own environment with ``trustbatch[ray]``). Without Ray the Ray tests are
skipped; the test that ``orchestrator=ray`` names the extra runs everywhere (it hides Ray if present).
"""

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.recipes import train

from runproc import alive, descendants, one_line, records, start, survivors
from tiny import TINY

SKIP_REASON = "Ray is not installed (pip install 'trustbatch[ray]'; `make test-ray` builds an env with it)"
SIGNAL = ["reward.name=scorers_for_tests:digit_fraction", "reward.workers=0", "threads=1"]
RAY = ["orchestrator=ray", "rollout.mode=async", "eval.every=100"]
TIMING = {"tokens_per_s", "rollout_s", "step_s", "learner_wait_s"}
ASYNC_ONLY = {"learner_wait_s", "max_staleness", "batches_dropped_stale", "worker_restarts"}


@pytest.fixture
def cache(tmp_path, monkeypatch, support_on_pythonpath):
    # support_on_pythonpath: Ray's worker processes inherit the environment of the raylet that ray.init starts, and
    # they import the scorer
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a new local cluster, whatever the shell says
    # a local cluster for one test needs no token; Ray would otherwise write one to ~/.ray and set
    # RAY_AUTH_MODE in this process's environment for the rest of the session
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


def _born(pid: int) -> int | None:
    """The start time of a running ``pid`` (clock ticks after boot, /proc/PID/stat field 22): with the pid it names
    one process, whatever pid reuse follows; None once it has ended (a zombie has ended)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


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

    def survivors(self, grace_s: float = 0.0) -> list[tuple[int, bytes]]:
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
    with _Watch() as watch:  # 2 rollout actors and 1 learner actor (ray_learners defaults to 1)
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
    assert sum(c.startswith(b"ray::LearnerRank") for c in watch.seen.values()) == 1, "no Ray actor was the learner"
    _assert_ray_gone(ray, watch)


@pytest.mark.ray
def test_ray_actors_at_k0_write_the_sync_metrics_through_a_resume(tmp_path, cache):
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    base = TINY + SIGNAL + ["eval.every=100"]
    train(load_config(None, base + ["train.steps=3", f"run_dir={tmp_path / 'sync'}"]))
    with _Watch() as watch:  # two segments: the learner actor's checkpoint (optimizer, version, stream) resumes
        train(load_config(None, base + RAY + ["train.steps=2", f"run_dir={tmp_path / 'ray'}",
                                              "rollout.max_staleness=0", "rollout.workers=2"]))
        train(resume=str(tmp_path / "ray"), overrides=["train.steps=3"])
    sync, viaray = records(tmp_path / "sync"), records(tmp_path / "ray")
    assert [r["step"] for r in sync] == [r["step"] for r in viaray] == [0, 1, 2, 3]
    assert any(abs(r.get("loss", 0.0)) > 1e-6 for r in sync)  # the comparison covers real updates
    assert "heldout_accuracy" in viaray[2] and "heldout_accuracy" not in sync[2]  # the first segment's last round
    viaray[2] = {k: v for k, v in viaray[2].items() if not k.startswith("heldout_")}  # (its own random stream)
    # weights from the learner actor through the object store, batches from rollout actors: bit for bit
    for a, b in zip(sync, viaray):
        assert {k: v for k, v in a.items() if k not in TIMING} == \
               {k: v for k, v in b.items() if k not in TIMING | ASYNC_ONLY}
    assert sum(c.startswith(b"ray::LearnerRank") for c in watch.seen.values()) == 2  # one per segment
    _assert_ray_gone(ray, watch)


@pytest.mark.ray
def test_ray_actors_in_deterministic_order_write_the_process_workers_metrics_through_a_resume(tmp_path, cache):
    # issue 39: at k = 2 with two workers, batch b is sampled by version max(0, b − 2) whatever carries it, and a
    # resume reloads the two older versions' weights from the checkpoint
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    base = TINY + SIGNAL + ["eval.every=100", "rollout.mode=async", "rollout.max_staleness=2", "rollout.workers=2"]
    train(load_config(None, base + ["train.steps=5", f"run_dir={tmp_path / 'procs'}"]))
    with _Watch() as watch:
        train(load_config(None, base + RAY + ["train.steps=3", f"run_dir={tmp_path / 'ray'}"]))
        train(resume=str(tmp_path / "ray"), overrides=["train.steps=5"])
    procs, viaray = records(tmp_path / "procs"), records(tmp_path / "ray")
    assert [r["behaviour_version"] for r in procs[1:]] == [0, 0, 0, 1, 2]
    viaray[3] = {k: v for k, v in viaray[3].items() if not k.startswith("heldout_")}  # the first segment's end
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in procs] == \
           [{k: v for k, v in r.items() if k not in TIMING} for r in viaray]
    _assert_ray_gone(ray, watch)


@pytest.mark.ray
def test_ray_workers_with_the_exact_kl_write_the_process_workers_metrics(tmp_path, cache):
    # kl=exact at k = 2: the learner in the driver (ray_learners=0) rebuilds each batch's behaviour from the pushed
    # weights of its version (weight_sync.BehaviourVersions), whatever carries the batch: the same KL, loss and weights
    # path as process workers (their rebuilt log-probs against the recorded ones: test_async_exact_kl.py)
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    base = TINY + SIGNAL + ["eval.every=100", "rollout.mode=async", "rollout.max_staleness=2", "rollout.workers=2",
                            "train.steps=4", "objective.options={kl: exact}"]
    train(load_config(None, base + [f"run_dir={tmp_path / 'procs'}"]))
    with _Watch() as watch:
        train(load_config(None, base + RAY + ["ray_learners=0", f"run_dir={tmp_path / 'ray'}"]))
    procs, viaray = records(tmp_path / "procs"), records(tmp_path / "ray")
    assert [r["behaviour_version"] for r in procs[1:]] == [0, 0, 0, 1]
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in procs] == \
           [{k: v for k, v in r.items() if k not in TIMING} for r in viaray]
    assert all(-1e-6 < r["kl_behavior"] < float("inf") for r in viaray[1:]) and viaray[-1]["kl_behavior"] > 1e-6
    _assert_ray_gone(ray, watch)


def _swap_in_recording_sgd(learner):
    from grad_probe import sgd_recording_grads

    learner.recorded_grads = sgd_recording_grads(learner, learner.model)


def _grads_and_weights(learner):
    return learner.recorded_grads, {n: p.detach().clone() for n, p in learner.model.named_parameters()}


@pytest.mark.ray
@pytest.mark.parametrize("objective", ["p3o", "p3o_two_anchor"])
def test_two_ray_learner_ranks_equal_one_process_on_the_whole_batch(cache, objective):
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    from test_parallel import _batch, _close, _model

    from trustbatch.orchestration.ray_learner import RayLearnerGroup
    from trustbatch.trainer.learner import Learner

    from grad_probe import sgd_recording_grads

    kw = dict(lr=1e-2, grad_clip=1e9)
    want_model = _model()  # float64
    want = Learner(want_model, objective, {}, micro_batch_size=64, **kw)
    want_grads = sgd_recording_grads(want, want_model)
    want_metrics = want.train_on(_batch())
    # 5 rows: rank 0 trains on 3 and rank 1 on 2, with unequal token counts; micro-batches of 2 rows
    group = RayLearnerGroup(_model(), objective, {}, ranks=2, micro_batch_size=2, **kw)
    try:
        group.execute(_swap_in_recording_sgd)
        metrics = group.train_on(_batch())
        ranks = group.execute(_grads_and_weights)
        assert group.version == want.version == 1
    finally:
        group.close()
    assert not ray.is_initialized()
    assert max(g.abs().max() for g in want_grads.values()) > 1e-3  # a 1/world-size slip would show
    for rank, (grads, weights) in enumerate(ranks):
        for n, p in want_model.named_parameters():
            _close(grads[n], want_grads[n], f"{objective} grad {n} rank {rank}")
            _close(weights[n], p.detach(), f"{objective} weight {n} rank {rank}")
    for n, p in want_model.named_parameters():  # the driver's copy is rank 0's
        _close(dict(group.model.named_parameters())[n].detach(), p.detach(), f"{objective} driver weight {n}")
    for k in ("ess", "loss", "num_tokens"):  # whole-batch statistics, all-reduced over the ranks (float32 ratios)
        assert abs(metrics[k] - want_metrics[k]) <= 1e-6 * max(1.0, abs(want_metrics[k])), (k, metrics[k], want_metrics[k])


@pytest.mark.ray
def test_a_ray_learner_hands_back_each_optimizer_steps_record(cache):
    """Per-step traces through Ray (issue 14, item 8): one rank with 2 epochs × 2 mini-batches returns the same
    step records as a ``Learner`` in this process on the same batch from the same torch stream (float64)."""
    pytest.importorskip("ray", reason=SKIP_REASON)
    from test_parallel import _batch, _model

    from trustbatch.orchestration.ray_learner import RayLearnerGroup
    from trustbatch.trainer.learner import Learner

    kw = dict(lr=1e-2, grad_clip=1e9, micro_batch_size=64, epochs=2, minibatches=2)
    # _model() seeds torch, and rank 0 starts from the driver's torch stream as it is after _model(): both
    # learners draw the same mini-batch permutations
    want = Learner(_model(), "p3o", {}, **kw)
    want.train_on(_batch())
    group = RayLearnerGroup(_model(), "p3o", {}, ranks=1, **kw)
    try:
        group.train_on(_batch())
    finally:
        group.close()
    assert [(r["opt_step"], r["epoch"], r["minibatch"]) for r in group.step_records] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for got, ref in zip(group.step_records, want.step_records):
        for k in ("ess", "kl_weight", "grad_norm", "loss"):
            assert abs(got[k] - ref[k]) <= 1e-9 * max(1.0, abs(ref[k])), (got["opt_step"], k, got[k], ref[k])
    assert len({round(r["ess"], 9) for r in group.step_records}) > 1


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

    with KillOne() as watch:  # the learner in the driver (ray_learners=0), as before learner actors existed
        train(load_config(None, TINY + SIGNAL + RAY + ["train.steps=8", f"run_dir={run}", "rollout.workers=2",
                                                       "rollout.max_staleness=1", "ray_learners=0"]))
    assert killed, "the run ended before an actor could be killed"
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(9))
    assert recs[-1]["worker_restarts"] >= 1
    assert all(r["staleness"] <= 1 for r in recs[1:])
    _assert_ray_gone(ray, watch)


@pytest.mark.ray
def test_a_local_ray_run_writes_no_token_in_home_and_leaves_no_process(tmp_path, cache):
    """Issue 39 item 5, through the CLI in a fresh process with none of Ray's auth settings: Ray 2.60 would write
    ``~/.ray/auth_token`` for the local cluster it starts, and its actor processes outlived the driver by seconds."""
    pytest.importorskip("ray", reason=SKIP_REASON)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    cmd = [sys.executable, "-m", "trustbatch", "train", *TINY, *SIGNAL, *RAY, "train.steps=1", "rollout.workers=1",
           f"run_dir={tmp_path / 'run'}"]
    seen: dict[int, bytes] = {}
    with open(tmp_path / "out.log", "w") as out:
        proc = subprocess.Popen(cmd, env={**env, "HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                for p in descendants(proc.pid):
                    seen[p] = _cmdline(p) or seen.get(p, b"")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
    left = [(p, seen[p][:80]) for p in seen if alive(p)]  # at once: the driver waited for them before it exited
    assert proc.returncode == 0, (tmp_path / "out.log").read_text()[-3000:]
    assert any(c.startswith(b"ray::RolloutWorker") for c in seen.values()), "no Ray actor was seen"
    assert not left, f"processes outlived the run: {left}"
    assert not (home / ".ray" / "auth_token").exists()


@pytest.mark.ray
def test_a_local_cluster_in_a_container_with_a_cpu_quota_gets_the_cpus_the_run_needs(cache, monkeypatch):
    """Ray sizes a local cluster from the container's CPU quota (cgroups), not the cores: with a quota below them
    and a run needing no more than the cores, the cluster got the quota's CPUs and the run was refused ("the Ray
    cluster has 1 CPUs but ... actors need one each"). The quota is Ray's own get_num_cpus, made to say 1."""
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    from trustbatch.orchestration.ray_cluster import close_actors, connect

    monkeypatch.setattr(ray._private.utils, "get_num_cpus", lambda *a, **k: 1)
    cpus = os.cpu_count()
    started = connect(None, cpus)
    try:
        assert started and ray.cluster_resources()["CPU"] >= cpus
    finally:
        close_actors(ray, [], started_ray=started)


@pytest.mark.ray
def test_an_unreachable_ray_address_is_one_line_and_exit_2(tmp_path, cache):
    pytest.importorskip("ray", reason=SKIP_REASON)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "trustbatch", "train", *TINY, *SIGNAL, *RAY, f"ray_address=127.0.0.1:{port}",
           f"run_dir={tmp_path / 'run'}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    line = one_line(p.stderr)
    assert f"ray_address=127.0.0.1:{port}" in line and "ray start --head" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.ray
def test_a_killed_ray_driver_takes_its_local_cluster_with_it(tmp_path, cache):
    """Issue 46 item 3: ``kill -9`` of ``trustbatch train`` once its local cluster and actors run; 10 s later no process
    of that cluster runs. The cluster's processes are the driver's descendants, recorded by pid and start time while
    it lived (so no other Ray on this machine counts, whatever pid reuse follows). Before the reaper, Ray's
    DashboardAgent and RuntimeEnvAgent (children of the raylet) outlived the driver by a minute or more."""
    pytest.importorskip("ray", reason=SKIP_REASON)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "trustbatch", "train", *TINY, *SIGNAL, *RAY, "train.steps=500", "rollout.workers=1",
           f"run_dir={run}"]
    proc = start(cmd, tmp_path / "out.log")
    seen: dict[tuple[int, int], bytes] = {}  # (pid, start time) -> its latest command line
    # the whole cluster (the two agents are what outlived a killed driver) and the run's actors
    whole = (b"gcs_server", b"raylet", b"ray::DashboardAgent", b"ray::RuntimeEnvAgent", b"ray::RolloutWorker",
             b"ray::LearnerRank")

    def record():
        for p in descendants(proc.pid):
            if (t := _born(p)) is not None:
                seen[p, t] = _cmdline(p) or seen.get((p, t), b"")

    try:
        deadline = time.monotonic() + 180
        while not all(name in b" ".join(seen.values()) for name in whole):
            assert proc.poll() is None, (tmp_path / "out.log.err").read_text()[-3000:]
            assert time.monotonic() < deadline, f"not all of {whole} ran within 180 s: {sorted(seen.values())}"
            record()
            time.sleep(0.05)
        for _ in range(20):  # a second more: the actors at work
            record()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert proc.wait(10) == -signal.SIGKILL
        left = list(seen)
        while left and time.monotonic() - killed_at < 10.0:
            time.sleep(0.1)
            left = [(p, t) for p, t in left if _born(p) == t]
        gone_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        for p, t in seen:  # a failure leaves nothing running
            if _born(p) == t:
                os.kill(p, signal.SIGKILL)
    assert not left, f"10 s after the driver's SIGKILL: {[(p, seen[p, t][:60]) for p, t in left]}"
    print(f"the cluster's {len(seen)} processes were gone {gone_s:.1f} s after the driver's SIGKILL")


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # the test's output is its assertions
        pass


@pytest.mark.ray
def test_a_ray_address_that_answers_but_is_not_ray_is_one_line_and_exit_2_within_30_s(tmp_path, cache):
    """Issue 46 item 3: an HTTP server at ``ray_address`` (the dashboard's port is one); ``ray.init`` alone waited
    there for minutes, printing its own retries."""
    pytest.importorskip("ray", reason=SKIP_REASON)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    cmd = [sys.executable, "-m", "trustbatch", "train", *TINY, *SIGNAL, *RAY, f"ray_address=127.0.0.1:{port}",
           f"run_dir={tmp_path / 'run'}"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    line = one_line(p.stderr)
    assert line.startswith(f"trustbatch: error: ray_address=127.0.0.1:{port} answers but is not a Ray cluster (an HTTP server "
                           "answered"), line
    assert "ray start --head" in line, line
    assert took < 30, f"{took:.0f} s"
    assert not (tmp_path / "run").exists()


@pytest.mark.ray
def test_a_real_ray_gcs_passes_the_address_check(cache):
    """The HTTP/2 greeting ``check_reachable`` sends is answered by a real GCS (a local cluster's), in well under a
    second."""
    ray = pytest.importorskip("ray", reason=SKIP_REASON)
    from trustbatch.orchestration import ray_cluster

    started = ray_cluster.connect(None, cpus=1)
    try:
        address = ray.get_runtime_context().gcs_address
        t0 = time.monotonic()
        ray_cluster.check_reachable(address, timeout_s=5.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        ray_cluster.close_actors(ray, [], started)


def test_a_ray_address_is_tried_first_and_refused_in_one_line_naming_it(monkeypatch):
    """``ray_cluster.check_reachable`` needs no Ray: a real closed port, a real listening one that never answers, one
    that hangs up, a bad address, and a timeout (``socket.create_connection`` made to raise it, as a silently
    dropping firewall would). A real GCS passes: ``test_a_real_ray_gcs_passes_the_address_check``."""
    from trustbatch.orchestration import ray_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(UserError) as e:  # the kernel accepts the connection; nothing reads or answers
            ray_cluster.check_reachable(f"127.0.0.1:{port}", timeout_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 1.5
        assert str(e.value).startswith(f"ray_address=127.0.0.1:{port} answers but is not a Ray cluster (no answer to "
                                       "a gRPC greeting within 0.5 s): give the address `ray start --head` "
                                       "printed there"), e.value
        monkeypatch.setenv("RAY_USE_TLS", "1")  # a TLS GCS waits for a TLS handshake: only the connection is tried
        ray_cluster.check_reachable(f"127.0.0.1:{port}", timeout_s=0.5)
        monkeypatch.delenv("RAY_USE_TLS")
    with socket.socket() as hangs_up:
        hangs_up.bind(("127.0.0.1", 0))
        hangs_up.listen()
        t0 = time.monotonic()
        hang_up = threading.Thread(target=lambda: hangs_up.accept()[0].close())
        hang_up.start()
        with pytest.raises(UserError, match=r"not a Ray cluster \(it hung up on a gRPC greeting\)"):
            ray_cluster.check_reachable(f"127.0.0.1:{hangs_up.getsockname()[1]}", timeout_s=5.0)
        hang_up.join()
        assert time.monotonic() - t0 < 1.0  # at once, not at the timeout
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]  # bound, never listening: refused
            with pytest.raises(UserError) as e:
                ray_cluster.check_reachable(f"127.0.0.1:{port}")
            assert str(e.value).startswith(f"cannot reach the Ray cluster at ray_address=127.0.0.1:{port} (Connection "
                                           f"refused): start it there (`ray start --head --port={port}`)"), e.value
            monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")
            with pytest.raises(UserError, match=f"at RAY_ADDRESS=ray://127.0.0.1:{port} "):
                ray_cluster.check_reachable(None)
    ray_cluster.check_reachable("auto")  # Ray finds the cluster itself: nothing to try
    with pytest.raises(UserError, match="ray_address=head-node is not host:port"):
        ray_cluster.check_reachable("head-node")

    def silent(*a, **k):
        raise socket.timeout("timed out")

    monkeypatch.setattr(ray_cluster.socket, "create_connection", silent)
    with pytest.raises(UserError, match=r"at ray_address=10.0.0.5:6379 \(no answer within 0.5 s\)"):
        ray_cluster.check_reachable("10.0.0.5:6379", timeout_s=0.5)


def test_orchestrator_ray_without_ray_names_the_extra(tmp_path, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, installed or not
    with pytest.raises(UserError) as e:
        train(load_config(None, TINY + SIGNAL + RAY + ["train.steps=1", f"run_dir={tmp_path / 'run'}"]))
    assert str(e.value) == "orchestrator=ray needs Ray, which is not installed: pip install 'trustbatch[ray]'"


def test_orchestrator_ray_needs_async_mode(tmp_path, cache):
    with pytest.raises(UserError, match="rollout.mode=async"):
        train(load_config(None, TINY + SIGNAL + ["orchestrator=ray", "train.steps=1", f"run_dir={tmp_path / 'run'}"]))
