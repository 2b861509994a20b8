"""Issue 10: one run per directory, no orphaned processes, SIGTERM, NaN policy and unwritable or full disks.

Real ``trustbatch train`` processes, their process trees read from /proc, and the files they leave.
"""

import dataclasses
import errno
import shutil
import signal
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.policy import load_policy
from trustbatch.recipes import train
from trustbatch.trainer import checkpoint as ckpt_mod
from trustbatch.trainer.checkpoint import load_latest

from runproc import (cache, descendants, n_records, one_line, outlived, resume_args, run,  # noqa: F401
                     signal_and_wait, snapshot, start, survivors, train_args, wait_until, weights)
from test_resume import QUICK, _cli

LONG = ["train.steps=100000", "reward.workers=2"]  # runs until the test stops it


def _last_checkpoint_step(run_dir) -> int:
    return max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def test_lock_refuses_a_second_run_and_kill9_leaves_no_process_and_no_stale_lock(tmp_path, cache):
    run_dir = tmp_path / "run"
    first = start(train_args(run_dir, *LONG), tmp_path / "first.log")
    try:
        wait_until(first, lambda: n_records(run_dir) >= 3, "round 2")
        for args in (train_args(run_dir, *LONG), resume_args(run_dir)):
            second = run(args)
            assert second.returncode == 2, second.stderr[-3000:]
            line = one_line(second.stderr)
            assert f"in use by process {first.pid}" in line, line
        tree = descendants(first.pid)
        assert len(tree) >= 2, f"expected the reward workers under the trainer, got {tree}"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert survivors(tree) == [], "processes outlived the trainer killed with SIGKILL"
    # the dead owner's lock (its pid still in .lock) does not block a resume
    assert (run_dir / ".lock").read_text().strip() == str(first.pid)
    done = run(resume_args(run_dir, f"train.steps={_last_checkpoint_step(run_dir) + 1}"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "summary.json").is_file()


def test_kill9_of_the_torchrun_launcher_leaves_no_rank_and_no_worker(tmp_path, cache):
    """The ranks run in sessions of their own (torchrun's ``start_new_session``): only their parent-death watch stops
    them when the launcher is killed with SIGKILL, which no handler of torchrun's can see."""
    run_dir = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = start(launcher + train_args(run_dir, *LONG)[1:], tmp_path / "torchrun.log")
    try:
        # every process is up once each rank has its reward workers: the kill needs no more
        wait_until(proc, lambda: len(descendants(proc.pid)) >= 6, "2 ranks with 2 reward workers each", timeout=300)
        tree = descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert outlived(tree) == [], "processes outlived the torchrun launcher killed with SIGKILL"


def test_sigterm_stops_with_one_line_and_the_run_resumes(tmp_path, cache):
    run_dir = tmp_path / "run"
    proc = start(train_args(run_dir, *LONG), tmp_path / "run.log")
    try:
        wait_until(proc, lambda: n_records(run_dir) >= 3, "round 2")
        tree = descendants(proc.pid)
        assert len(tree) >= 2
    finally:
        rc, err = signal_and_wait(proc, signal.SIGTERM, tmp_path / "run.log")
    assert rc == 130, err[-3000:]  # documented in cli.main: Ctrl-C and SIGTERM exit 130
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    line = one_line(err)
    assert "interrupted" in line and f"--resume {run_dir}" in line, line
    assert survivors(tree) == []
    done = run(resume_args(run_dir, f"train.steps={_last_checkpoint_step(run_dir) + 1}"))
    assert done.returncode == 0, done.stderr[-3000:]


# ---- NaN: skipped steps, then one line; never a non-finite checkpoint --------------------------------------

def test_diverging_run_stops_with_one_line_and_no_nonfinite_checkpoint(tmp_path, cache, monkeypatch, capsys):
    # lr=1e38: the first Adam step puts weights at ±1e38, the next gradients are NaN (lr=1e4 stays finite here)
    run_dir = tmp_path / "run"
    code, err = _cli(monkeypatch, capsys, "train", *QUICK, "train.steps=4", "train.lr=1e38", "train.epochs=2",
                     "train.minibatches=2", f"run_dir={run_dir}")
    assert code == 2, err
    line = one_line(err)
    assert "non-finite" in line and "train.lr" in line, line
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved, "the step-0 checkpoint should exist"
    for c in saved:
        for name, t in weights(c).items():
            assert torch.isfinite(t).all(), (c.name, name)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_learner_skips_a_nonfinite_step_without_touching_weights_or_version():
    from llama_rows import learner_batch as _batch
    from trustbatch.policy.model import build_small_llama
    from trustbatch.policy.tokenizer import train_tokenizer
    from trustbatch.trainer import Learner
    from trustbatch.trainer.learner import NonFiniteTraining

    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3", "State the answer"], vocab_size=300)
    model = build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=32, seed=0, tokenizer=tok)
    learner = Learner(model, "p3o", lr=1e-2, max_bad_steps=2)
    good = learner.step(_batch(tok))  # a real step first, so the optimizer has state to protect
    assert good["nonfinite_skipped"] == 0 and learner.version == 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in learner.optimizer.state[next(model.parameters())].items()}

    def nonfinite(*a, **k):
        raise ValueError("p3o: the loss is not finite (nan)")

    learner.spec = dataclasses.replace(learner.spec, fn=nonfinite)
    m = learner.step(_batch(tok, seed=1))
    assert m["nonfinite_skipped"] == 1
    assert learner.version == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in learner.optimizer.state[next(model.parameters())].items():
        assert torch.equal(v, opt_before[k]), k
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(NonFiniteTraining, match="train.lr"):
        learner.step(_batch(tok, seed=2))  # the second in a row: max_bad_steps=2
    assert learner.version == 1


def test_nonfinite_weights_are_never_checkpointed(tmp_path, cache):
    run_dir = tmp_path / "run"
    train(load_config(None, QUICK + ["train.steps=1", f"run_dir={run_dir}"]))
    _, policy, _ = load_latest(run_dir, load_policy)
    before = snapshot(run_dir)
    with torch.no_grad():
        next(policy.model.parameters())[0] = float("nan")
    with pytest.raises(ckpt_mod.NonFiniteWeights, match="train.lr"):
        ckpt_mod.save_checkpoint(run_dir, 2, policy, {})
    assert snapshot(run_dir) == before  # nothing written, no temporary folder left


# ---- disks that cannot be written ---------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["under_a_file", "a_file", "proc"])
def test_unwritable_run_dir_is_one_line(tmp_path, cache, monkeypatch, capsys, where):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    run_dir = {"under_a_file": afile / "run", "a_file": afile, "proc": "/proc/1/no/run"}[where]
    code, err = _cli(monkeypatch, capsys, "train", *QUICK, "train.steps=1", f"run_dir={run_dir}")
    assert code == 2, err
    said = "is a file; give a directory" if where == "a_file" else "cannot write"
    assert "Traceback" not in err and said in one_line(err)
    assert afile.read_text() == "not a folder"


def test_full_disk_during_a_checkpoint_is_one_line_and_the_previous_checkpoint_survives(tmp_path, cache,
                                                                                        monkeypatch, capsys):
    run_dir = tmp_path / "run"
    real_save, calls = torch.save, []

    def filling_save(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 3:  # the third checkpoint (round 2): steps 0 and 1 are on disk
            with open(f, "wb") as out:
                out.write(b"\0" * 10)  # a torn write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", filling_save)
    code, err = _cli(monkeypatch, capsys, "train", *QUICK, "train.steps=3", f"run_dir={run_dir}")
    assert code == 2, err
    line = one_line(err)
    assert "No space left on device" in line and str(run_dir) in line, line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    path, _, state = load_latest(run_dir, load_policy)
    assert path.name == "step_000001" and state["step"] == 1
    code, err = _cli(monkeypatch, capsys, "train", "--resume", str(run_dir))
    assert code == 0, err
    assert (run_dir / "checkpoints" / "step_000003").is_dir()


@pytest.mark.parametrize("limit_kib, kept", [pytest.param(64, [], marks=pytest.mark.slow), (128, ["step_000000"])])
def test_a_file_size_limit_during_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path, cache, limit_kib, kept):
    """A file-size limit (``ulimit -f``) under which a checkpoint's files do not fit: 64 KiB refuses the weights of
    the step-0 checkpoint (93 KiB, safetensors: its error names os error 27; slow: tests/unit/test_refused_writes.py
    reads that error), 128 KiB the optimizer state of round 1's (209 KiB, torch.save: only the torn file at the
    limit tells it). Both ended in a traceback (reliability.md's known gap). A resume without the limit finishes the
    run."""
    import resource
    import subprocess

    from runproc import ROOT

    run_dir, limit = tmp_path / "run", limit_kib << 10
    p = subprocess.run(train_args(run_dir, "train.steps=2", "reward.workers=0"), cwd=ROOT, capture_output=True,
                       text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert p.returncode == 2, p.stderr[-3000:]
    line = one_line(p.stderr)
    assert "Traceback" not in p.stderr and f"cannot write {run_dir}/checkpoints (File too large" in line, line
    assert f"the file-size limit is {limit} bytes" in line and "raise the file-size limit" in line, line
    assert sorted(q.name for q in (run_dir / "checkpoints").iterdir()) == kept  # no torn folder left
    if kept:
        done = run(resume_args(run_dir))
        assert done.returncode == 0, done.stderr[-3000:]
        assert (run_dir / "checkpoints" / "step_000002").is_dir()


def _mount_namespaces() -> bool:
    """Whether this process may make a mount namespace and bind-mount in it (root with CAP_SYS_ADMIN)."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run(["unshare", "-m", "mount", "--bind", d, d], capture_output=True)
    return p.returncode == 0


@pytest.mark.skipif(not _mount_namespaces(), reason="needs `unshare -m` and mount (root with CAP_SYS_ADMIN)")
def test_a_disk_that_turns_read_only_during_a_checkpoint_write_is_one_line(tmp_path, cache):
    """Issue 46 item 2: safetensors raises its own error type on a read-only filesystem, which the one-line handler
    of unwritable run directories did not see. A real read-only remount (tests/support/readonly_checkpoint.py) just
    before the weights of the round-1 checkpoint are written."""
    from runproc import ROOT, SHORT

    run_dir = tmp_path / "run"
    p = run(["unshare", "-m", sys.executable, str(ROOT / "tests" / "support" / "readonly_checkpoint.py"), str(run_dir),
             "2", *SHORT, "train.steps=2", "reward.workers=0"])
    assert p.returncode == 2, p.stderr[-3000:]
    line = one_line(p.stderr)
    assert "Read-only file system" in line and f"{run_dir}/checkpoints" in line and "--resume" in line, line
    # the previous checkpoint is intact: a resume starts from it (the full-disk test above resumes one for real)
    path, _, state = load_latest(run_dir, load_policy)
    assert path.name == "step_000000" and state["step"] == 0


_Usage = namedtuple("usage", "total used free")  # shutil.disk_usage's result, in bytes


class _OneFilePolicy:
    """What save_checkpoint needs of a policy: a module, and a save that writes its weights file."""

    model = torch.nn.Linear(2, 2)

    def save(self, path):
        (path / "model.safetensors").write_bytes(b"x")


def test_torch_save_on_a_full_disk_is_an_enospc_oserror(tmp_path, monkeypatch):
    """torch.save raises RuntimeError, not OSError, when the disk fills: save_checkpoint names it ENOSPC."""
    def torn(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 448 vs 342")

    monkeypatch.setattr(ckpt_mod.torch, "save", torn)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(10 << 30, 10 << 30, 0))
    with pytest.raises(OSError) as e:
        ckpt_mod.save_checkpoint(tmp_path, 1, _OneFilePolicy(), {})
    assert e.value.errno == errno.ENOSPC
    assert not list((tmp_path / "checkpoints").iterdir())  # nothing half-written left behind
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(10 << 30, 0, 10 << 30))
    with pytest.raises(RuntimeError):  # with space left it is another fault: not disguised as a full disk
        ckpt_mod.save_checkpoint(tmp_path, 1, _OneFilePolicy(), {})


def test_a_full_disk_is_told_before_the_torn_checkpoint_is_removed(tmp_path, monkeypatch):
    """The torn file is what filled the disk: once it is removed the space is back. Here the disk has room exactly
    while no partial trainer_state.pt exists (as in a 0.5B run whose 3 GB optimizer state found 2.9 GB free), so the
    full-disk check must read the free space before the cleanup."""
    def torn(obj, f, *a, **k):
        Path(f).write_bytes(b"\0" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3047575104 vs 3047574996")

    root = tmp_path / "checkpoints"
    monkeypatch.setattr(ckpt_mod.torch, "save", torn)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(
        10 << 30, 0, 0 if list(root.glob(".tmp-*/trainer_state.pt")) else 10 << 30))
    with pytest.raises(OSError) as e:
        ckpt_mod.save_checkpoint(tmp_path, 1, _OneFilePolicy(), {})
    assert e.value.errno == errno.ENOSPC and "unexpected pos" in str(e.value)
    assert not list(root.iterdir())  # and nothing half-written is left


def test_the_checkpoint_just_written_survives_rotation_beside_a_later_rounds_folder(tmp_path):
    """A resume that fell back past a corrupt newest checkpoint (step 4) writes round 3's: with checkpoint_keep=1 the
    rotation kept the newest by name, step 4, and deleted the checkpoint it had just written."""
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)  # the corrupt one, left on disk
    ckpt_mod.save_checkpoint(tmp_path, 2, _OneFilePolicy(), {}, keep=1)
    written = ckpt_mod.save_checkpoint(tmp_path, 3, _OneFilePolicy(), {}, keep=1)
    assert written.is_dir() and (written / "trainer_state.pt").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000004"]


def test_runs_started_in_the_same_second_without_run_dir_each_get_their_own_directory(tmp_path, cache, monkeypatch,
                                                                                        capsys):
    """The default run directory is runs/<second>-<objective>: a run started in the same second as another (a sweep
    launching several at once) was refused ("in use by process ...") while the other held it, and with the other
    stopped before its first checkpoint, set its files aside as its own interrupted start. The other start here holds
    the names of the next 30 seconds (its lock and records); the reference is what it wrote, byte for byte."""
    from datetime import datetime, timedelta

    from trustbatch.recipes.rundir import RunLock

    monkeypatch.chdir(tmp_path)
    now = datetime.now()
    others = [tmp_path / "runs" / f"{now + timedelta(seconds=s):%Y%m%d-%H%M%S}-p3o" for s in range(30)]
    locks = []
    for d in others:
        locks.append(RunLock(d).__enter__())
        (d / "config.yaml").write_text("another run's\n")
    before = {d: snapshot(d) for d in others}
    try:
        code, err = _cli(monkeypatch, capsys, "train", *QUICK, "train.steps=1")
    finally:
        for lock in locks:
            lock.__exit__(None, None, None)
    assert code == 0, err
    ours = sorted(p for p in (tmp_path / "runs").iterdir() if p not in others)
    assert len(ours) == 1 and ours[0].name.endswith("-p3o-2"), ours
    assert (ours[0] / "summary.json").exists() and (ours[0] / "checkpoints").is_dir()
    assert {d: snapshot(d) for d in others} == before


def test_a_start_refused_by_the_lock_removes_nothing_of_the_run_that_holds_it(tmp_path, cache, monkeypatch, capsys):
    """Two starts on one run_dir: this one found no directory, the other made it and took the lock first. The
    refusal ("in use by process ...") is a UserError, and the cleanup of a directory "this start made" removed the
    live run's config.yaml and lock (it could then be neither resumed nor exported). Reference: the other run's
    files, byte for byte."""
    from trustbatch.recipes import rundir

    run_dir = tmp_path / "run"
    held = []
    enter = rundir.RunLock.__enter__

    def the_other_start_wins(self):
        if not held:  # between this start's look at the directory and its lock
            held.append(enter(rundir.RunLock(run_dir)))
            (run_dir / "config.yaml").write_text("the other run's\n")
        return enter(self)

    monkeypatch.setattr(rundir.RunLock, "__enter__", the_other_start_wins)
    before = None
    try:
        code, err = _cli(monkeypatch, capsys, "train", *QUICK, "train.steps=1", f"run_dir={run_dir}")
        before = snapshot(run_dir)
        assert (run_dir / ".lock").exists()
    finally:
        held and held[0].__exit__(None, None, None)
    assert code == 2 and "is in use by process" in err, err
    assert before == {"config.yaml": b"the other run's\n"}


def test_a_run_dir_of_the_users_own_files_is_refused_and_nothing_in_it_moves(tmp_path, cache, monkeypatch, capsys):
    """A folder where the user keeps a config.yaml (and notes, data) was taken for a start interrupted before its
    first checkpoint: every file was moved into interrupted-*/, the note said so, and the run then failed on the data
    file it had moved. Every start takes the directory's .lock first; without one the files are the user's.
    Reference: the folder's files, byte for byte."""
    exp = tmp_path / "exp"
    (exp / "data").mkdir(parents=True)
    (exp / "config.yaml").write_text("train:\n  steps: 1\n")
    (exp / "NOTES.md").write_text("my notes\n")
    (exp / "data" / "rows.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    before = snapshot(exp)
    code, err = _cli(monkeypatch, capsys, "train", "--config", str(exp / "config.yaml"), *QUICK, f"run_dir={exp}")
    assert code == 2 and "no trustbatch run wrote there" in err and "nothing in it was moved" in err, err
    assert snapshot(exp) == before and not (exp / ".lock").exists()
