"""The asynchronous rollout source: k = 0 reproduces the sync source, the staleness bound holds, the
controller follows its rule, and a killed rollout worker is replaced without leaving processes behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trustbatch.config import load_config
from trustbatch.pipeline.async_source import order_ahead
from trustbatch.pipeline.staleness import (StalenessController, behaviour_round, may_start, rounds_ahead,
                                         too_stale)
from trustbatch.recipes import train

from tiny import TINY

TIMING = {"tokens_per_s", "rollout_s", "step_s", "learner_wait_s"}
ASYNC_ONLY = {"learner_wait_s", "max_staleness", "batches_dropped_stale", "worker_restarts"}
# a reward with spread for an untrained policy, so the comparison covers non-zero advantages and updates
SIGNAL = ["reward.name=scorers_for_tests:digit_fraction", "reward.workers=0", "threads=1"]


@pytest.fixture
def cache(tmp_path, monkeypatch, support_on_pythonpath):  # spawned rollout workers import the scorer module too
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))


def _records(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_async_at_k0_writes_the_sync_metrics(tmp_path, cache, precision):
    """Under bf16-mixed the workers sample under the learner's autocast, as the sync engine (its own module) does:
    they sampled in float32, and P3O's cap bound on ~half the tokens of these staleness-0 batches."""
    base = TINY + SIGNAL + ["train.steps=4", f"train.precision={precision}"]
    train(load_config(None, base + [f"run_dir={tmp_path / 'sync'}"]))
    train(load_config(None, base + [f"run_dir={tmp_path / 'async'}", "rollout.mode=async", "rollout.max_staleness=0"]))
    sync, asyn = _records(tmp_path / "sync"), _records(tmp_path / "async")
    assert [r["step"] for r in sync] == [r["step"] for r in asyn] == [0, 1, 2, 3, 4]
    assert any(abs(r.get("loss", 0.0)) > 1e-6 for r in sync)  # the comparison covers real updates
    for a, b in zip(sync, asyn):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING | ASYNC_ONLY}
    assert all(r["staleness"] == 0 and r["max_staleness"] == 0 for r in asyn[1:])


def test_the_simulated_lag_samples_under_the_learners_autocast(tmp_path, cache):
    """``rollout.staleness`` samples from a lagged float32 copy: under bf16-mixed, under the learner's autocast as the
    sync engine, so its first round (nothing to lag yet) is the sync run's (it sampled in float32: off-policy)."""
    base = TINY + SIGNAL + ["train.steps=1", "eval.every=100", "train.precision=bf16-mixed"]
    train(load_config(None, base + [f"run_dir={tmp_path / 'sync'}"]))
    train(load_config(None, base + [f"run_dir={tmp_path / 'lag'}", "rollout.staleness=1"]))
    sync, lag = _records(tmp_path / "sync")[-1], _records(tmp_path / "lag")[-1]
    assert lag["step"] == 1 and lag["cap_fraction"] == 0.0
    assert {k: v for k, v in sync.items() if k not in TIMING} == {k: v for k, v in lag.items() if k not in TIMING}


@pytest.mark.parametrize("k,workers", [(1, 1), (3, 2)])
def test_no_sample_older_than_k_is_trained_on(tmp_path, cache, k, workers):
    run = tmp_path / "run"
    train(load_config(None, TINY + SIGNAL + ["train.steps=6", "eval.every=100", f"run_dir={run}", "rollout.mode=async",
                                             f"rollout.max_staleness={k}", f"rollout.workers={workers}"]))
    recs = _records(run)[1:]
    for r in recs:
        # staleness from the samples' tags: learner version at the round's first step − the oldest row's version
        assert r["policy_version"] - r["optimizer_steps"] - r["behaviour_version"] == r["staleness"]
        assert 0 <= r["staleness"] <= k, r
    assert max(r["staleness"] for r in recs) >= 1  # the pipeline did run ahead


def test_staleness_rules_by_hand():
    assert rounds_ahead(3, 1) == 3 and rounds_ahead(3, 2) == 1 and rounds_ahead(1, 4) == 0
    assert may_start(5, requested=5, max_staleness=0, steps_per_round=1)
    assert not may_start(6, requested=5, max_staleness=0, steps_per_round=1)
    assert may_start(7, requested=5, max_staleness=2, steps_per_round=1)
    assert not may_start(7, requested=5, max_staleness=3, steps_per_round=2)  # 3 versions = 1 round of 2 steps
    assert too_stale(10, 6, 3) and not too_stale(10, 7, 3)
    # deterministic order: batch b is sampled by round max(floor, b − ahead)
    assert [behaviour_round(b, 2) for b in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [behaviour_round(b, 2, floor=4) for b in range(4, 8)] == [4, 4, 4, 5]  # a resume without snapshots
    assert order_ahead("deterministic", 3, 2) == 1 and order_ahead("deterministic", 0, 1) == 0
    assert order_ahead("latest", 3, 1) is None and order_ahead("deterministic", "auto", 1) is None


@pytest.mark.parametrize("sequence,expected", [
    # (ess, learner_wait_s, round_s) per round -> k after each round; start k = 1, bounds [0, 8]
    ([(0.99, 1.0, 2.0)] * 3, [2, 3, 4]),                         # on-policy and waiting: +1 each round
    ([(0.99, 0.0, 2.0)] * 3, [1, 1, 1]),                         # on-policy but never waiting: keep
    ([(0.99, 1.0, 2.0)] * 4 + [(0.5, 1.0, 2.0)] * 2, [2, 3, 4, 5, 2, 1]),  # trust falls: halve
    ([(0.93, 1.0, 2.0)] * 2, [1, 1]),                            # between the thresholds: keep
    ([(0.99, 1.0, 2.0)] * 10, [2, 3, 4, 5, 6, 7, 8, 8, 8, 8]),   # capped at k_max
    ([(0.1, 1.0, 2.0)] * 2, [0, 0]),                             # floored at k_min
    ([(None, 1.0, 2.0)], [1]),                                   # an objective without ESS: keep
])
def test_controller_follows_its_rule(sequence, expected):
    c = StalenessController()
    assert [c.update(*x) for x in sequence] == expected


def _descendants(pid: int) -> set[int]:
    children = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _children(pid: int) -> list[int]:
    return [c for c in _descendants(pid) if _ppid(c) == pid]


def _ppid(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _report_hang(p, log: Path, killed: int | None) -> None:
    """Fail with what a hung run was doing: its processes, and every thread's stack of the trainer (faulthandler's
    dump on SIGABRT); nothing is left running."""
    tree = {c: (Path("/proc") / str(c) / "cmdline").read_bytes().replace(b"\0", b" ")[:120] for c in _descendants(p.pid)
            if _alive(c)}
    p.send_signal(signal.SIGABRT)
    try:
        p.wait(30)
    finally:
        for c in tree:
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass
    pytest.fail(f"the run hung (worker {killed} killed); alive: {tree}\n{log.read_text()[-8000:]}")


def test_a_killed_rollout_worker_is_restarted_and_nothing_survives(tmp_path, cache):
    run = tmp_path / "run"
    # faulthandler: a hang is reported with every thread's stack (SIGABRT below); output to a file, which no process
    # left behind can hold open as it could a pipe (communicate() then waited on it, and said nothing more)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "trustbatch", "train", *TINY, *SIGNAL, "reward.workers=1", "train.steps=16",
           "eval.every=100", f"run_dir={run}", "rollout.mode=async", "rollout.max_staleness=1"]
    log = tmp_path / "train.err"
    with open(log, "w") as err_file:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err_file, text=True)
    seen: set[int] = set()
    killed = None
    deadline = time.time() + 240
    while p.poll() is None and time.time() < deadline:
        seen |= _descendants(p.pid)
        metrics = run / "metrics.jsonl"
        if killed is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            logged_at_kill = len(metrics.read_text().splitlines())
            workers = [c for c in _children(p.pid)  # rollout workers: the trainer's own spawned children
                       if b"spawn_main" in (Path("/proc") / str(c) / "cmdline").read_bytes()]
            assert workers, "no spawned rollout worker found"
            killed = workers[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    if p.poll() is None:
        _report_hang(p, log, killed)
    err = log.read_text()
    assert p.returncode == 0, err[-3000:]
    assert killed is not None
    recs = _records(run)
    assert [r["step"] for r in recs] == list(range(17))
    # the worker died with batches still to make (k = 1: at most one batch ahead of the learner)
    assert logged_at_kill <= 16 - 2, logged_at_kill
    assert recs[-1]["worker_restarts"] >= 1
    time.sleep(3)
    assert not [c for c in seen if _alive(c)], "processes outlived the run"


def test_a_hung_rollout_worker_is_killed_after_the_timeout_restarted_and_nothing_survives(tmp_path, cache, monkeypatch):
    import threading

    run, timeout_s, after = tmp_path / "run", 2.0, 1
    marker = tmp_path / "hang"
    marker.touch()
    monkeypatch.setenv("TRUSTBATCH_TEST_HANG_MARKER", str(marker))
    # 4 prompts × 4 completions a batch: the first worker hangs while scoring its second batch
    monkeypatch.setenv("TRUSTBATCH_TEST_HANG_AFTER", str(after * 16))
    monkeypatch.setenv("TRUSTBATCH_TEST_HANG_SPARE_PID", str(os.getpid()))  # evaluation scores in this process
    seen: set[int] = set()
    stop = threading.Event()

    def watch():  # every descendant of this process while the run goes on
        while not stop.is_set():
            seen.update(_descendants(os.getpid()))
            time.sleep(0.05)

    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # the test process's own helper for its whole life, not the run's
    before = _descendants(os.getpid())
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        train(load_config(None, TINY + ["reward.name=scorers_for_tests:hang_once", "reward.workers=0", "threads=1",
                                        "train.steps=4", "eval.every=100", f"run_dir={run}", "rollout.mode=async",
                                        "rollout.max_staleness=1", f"rollout.worker_timeout_s={timeout_s}"]))
    finally:
        stop.set()
        watcher.join()
    claimed = list(tmp_path.glob("hang.*"))
    assert len(claimed) == 1, "no worker hung: the test did not test anything"
    hung = int(claimed[0].suffix[1:])
    assert hung in seen, "the process that hung was not a rollout worker of this run"
    recs = _records(run)
    assert [r["step"] for r in recs] == list(range(5))
    restarts = [r["worker_restarts"] for r in recs[1:]]
    first = next(i for i, n in enumerate(restarts) if n > 0)
    # one restart, in the round that waited for the hung batch, and only after the timeout had passed
    assert restarts == [0] * first + [1] * (len(restarts) - first), restarts
    assert first >= after, restarts  # the batches before the hang came from the first worker
    # the hung worker stayed alive, so only the timeout can have replaced it
    assert recs[1 + first]["learner_wait_s"] >= timeout_s
    time.sleep(1)
    assert not _alive(hung), "the hung worker was not killed"
    assert not [p for p in seen - before if _alive(p)], "processes outlived the run"


def _send_forever(conn, n_bytes: int) -> None:
    from trustbatch.orchestration.process_rollout import _Sender

    _Sender(conn).put(("batch", 0, 1, b"x" * n_bytes))  # a real batch is larger than the pipe's 64 KiB
    time.sleep(60)  # killed meanwhile, its message half sent


def _hold_the_lock(lock, holder) -> None:
    with lock:
        holder.value = 0
        time.sleep(60)  # killed while it loads a round's weights


def _killed_holding(ctx, lock, holder):
    """A process (worker 0) killed with SIGKILL while it holds ``lock``, its ``holder`` written."""
    proc = ctx.Process(target=_hold_the_lock, args=(lock, holder))
    proc.start()
    while holder.value != 0:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    return proc


def test_a_worker_killed_mid_message_or_holding_the_weights_lock_does_not_hang_the_learner():
    """Both hung the learner for good, so the health check never ran and the worker was never restarted: a worker
    killed while its batch drained into the shared queue left half a message and the queue's write lock (the
    learner blocked inside Queue.get; 429 kB batches, a reviewer's run), and one killed while it loaded weights
    under weights_lock left the lock held (the learner blocked in push). Real processes, killed with SIGKILL."""
    import multiprocessing

    from trustbatch.orchestration.process_rollout import ProcessTransport

    ctx = multiprocessing.get_context("spawn")
    transport = object.__new__(ProcessTransport)  # its pipes and lock alone: no model, no worker spec
    reader, writer = ctx.Pipe(duplex=False)
    sender = ctx.Process(target=_send_forever, args=(writer, 8 << 20))
    sender.start()
    writer.close()
    transport.readers, transport._draining = [reader], []
    assert reader.poll(60)  # it began sending
    os.kill(sender.pid, signal.SIGKILL)
    sender.join()
    t0 = time.time()
    assert transport.poll(1.0) is None and transport.readers == [None]  # its end, not a wait for the rest
    assert time.time() - t0 < 10

    class _Held:
        weights_lock, holder = ctx.Lock(), ctx.Value("q", -1, lock=False)
        claim_lock, claim_holder = ctx.Lock(), ctx.Value("q", -1, lock=False)

    transport.shared, transport.procs = _Held, [_killed_holding(ctx, _Held.weights_lock, _Held.holder)]
    t0 = time.time()
    with transport._weights_locked():
        assert _Held.holder.value == -1
    assert time.time() - t0 < 10 and _Held.weights_lock.acquire(timeout=1)
    _Held.weights_lock.release()
    # killed while the learner waited for its batch: the health check restarts it, and its replacement (the same
    # worker id, alive) would wait for the lock for good; the restart releases it
    _Held.claimed, _Held.started = [3], [1.0]
    transport.procs = [_killed_holding(ctx, _Held.weights_lock, _Held.holder)]
    transport.first, transport._start = [-1], lambda wid, first: None
    transport.restart(0, 3)
    assert _Held.holder.value == -1 and _Held.weights_lock.acquire(timeout=1)
    _Held.weights_lock.release()
    # the same for the claim lock: every other worker, and the replacement, would wait for it for good
    transport.procs = [_killed_holding(ctx, _Held.claim_lock, _Held.claim_holder)]
    transport.restart(0, 3)
    assert _Held.claim_holder.value == -1 and _Held.claim_lock.acquire(timeout=1)


def test_a_worker_killed_right_after_claiming_holds_its_batch():
    """A claim writes ``claimed`` before the counter moves on: a worker killed between the two holds the index, so
    its restart makes it (held). In the other order the index had no maker and the learner waited for it for good.
    The death is a raise at the counter's write; the same shared state then tells what a restart would make."""
    import multiprocessing

    from trustbatch.orchestration.process_rollout import ProcessTransport, _claim

    ctx = multiprocessing.get_context("spawn")

    class _Dies:
        value = 7

        def __setattr__(self, name, value):
            raise SystemExit("killed")

    class _Shared:
        claim_lock, claim_holder = ctx.Lock(), ctx.Value("q", -1, lock=False)
        claimed, next_index = ctx.Array("q", [-1, -1], lock=False), _Dies()

    with pytest.raises(SystemExit):
        _claim(1, _Shared)
    transport = object.__new__(ProcessTransport)
    transport.shared, transport.first = _Shared, [-1, -1]
    assert transport.held(1) == 7  # what BoundedSource._restart has the replacement make first
    # a raise leaves the lock (a death would not: the test above); the holder it wrote stays
    assert _Shared.claim_holder.value == 1 and _Shared.claim_lock.acquire(timeout=1)
    _Shared.claim_lock.release()
    _Shared.next_index, _Shared.claim_holder.value = ctx.Value("q", 7, lock=False), -1
    assert _claim(0, _Shared) == 7 and _Shared.claimed[0] == 7 and _Shared.next_index.value == 8
