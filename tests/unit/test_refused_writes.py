"""A write the disk refuses (full, read-only, no permission) ends a command on one line naming what could not be
written and where, and leaves nothing half-written; found by driving real full disks (small tmpfs mounts) in review.
Here the refusal is an injected ``OSError(ENOSPC)``, or a writer's own error on a disk with no space left."""

import errno
import shutil

import pytest

from trustbatch.errors import UserError


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_eval_out_on_a_full_disk_is_one_line_and_no_file(tmp_path, monkeypatch):
    from trustbatch import records
    from trustbatch.recipes.evaluate import save_results

    monkeypatch.setattr(records, "atomic_write", _enospc)
    with pytest.raises(UserError, match=r"cannot write --out .*out.json.* \(No space left on device\); free disk"):
        save_results({"average": {}}, tmp_path / "out.json")
    assert list(tmp_path.iterdir()) == []


def test_a_staged_output_on_a_full_disk_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """``export`` and ``sft --out`` write through ``staged_folder``: safetensors' own error on a full disk (free space
    below the threshold) and a bare ENOSPC both end as one line; the staged folder is removed."""
    from trustbatch import records
    from trustbatch.recipes.outputs import staged_folder

    class SafetensorError(Exception):  # safetensors' error type, by name
        pass

    with pytest.raises(UserError, match="cannot write --out"):
        with staged_folder(tmp_path / "model") as tmp:
            (tmp / "config.json").write_text("{}")
            _enospc()
    monkeypatch.setattr(records.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(UserError, match="no space left"):
        with staged_folder(tmp_path / "model"):
            raise SafetensorError("Error while serializing: I/O error")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):  # another fault passes as it is
        with staged_folder(tmp_path / "model"):
            raise ValueError("not a write")


def test_a_base_build_into_a_full_cache_names_the_cache(tmp_path, monkeypatch):
    from trustbatch.config import load_config
    from trustbatch.policy import model as policy_model
    from trustbatch.recipes import prepare_run

    from tiny import TINY

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(policy_model.Policy, "save", _enospc)
    with pytest.raises(UserError, match=r"cannot write the base into the cache .*; .*TRUSTBATCH_CACHE"):
        prepare_run(load_config(None, TINY + ["reward.workers=0", "model.sft_steps=1"]))
    assert [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".tmp-")] == []


def test_a_refused_scoring_marker_leaves_no_empty_marker(tmp_path, monkeypatch):
    """With ``reward.workers=0`` the pool writes a marker while the scorer runs, read at the next start as a crash in
    the scorer; a marker the disk refused stayed behind empty, and the resume blamed the user's scorer."""
    from pathlib import Path

    from trustbatch.rewards import RewardPool

    marker = tmp_path / "scoring_in_process.json"
    pool = RewardPool("gsm8k", workers=0)
    pool.in_process_marker = str(marker)  # as train sets it (recipes.train)
    real = Path.write_text

    def refuse(self, *a, **k):
        if self == marker:
            real(self, "")  # what a full disk leaves: the file made, nothing in it
            _enospc()
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(OSError):
        pool.score(["#### 5"], ["5"])
    assert not marker.exists()
    pool.close()


TB_SCRIPT = """
import errno, sys, time
from pathlib import Path
from trustbatch.trainer.trackers.tensorboard import TensorBoardTracker

def enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")

t = TensorBoardTracker()
t.start({}, Path(sys.argv[1]), None, {"through": -1})
t._writer.file_writer.event_writer._async_writer._writer.write = enospc
try:
    for step in range(100):  # the thread fails on its next write; flush then raises its error here
        t.log({"loss": 1.0}, step)
        time.sleep(0.01)
except OSError as e:
    print("main thread:", e.strerror, flush=True)
"""


def test_tensorboards_writer_thread_prints_no_traceback_for_a_refused_write(tmp_path):
    """TensorBoard's writer thread printed its traceback ("Exception in thread Thread-1: ...") into the one line a
    full disk ends a run with; the same error reaches the main thread at ``flush``, where the run says it. In a
    process of its own: pytest replaces the thread hook with its own."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", TB_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.stdout == "main thread: No space left on device\n", (p.stdout, p.stderr[-2000:])
    assert "Exception in thread" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_file_the_staged_block_cannot_read_is_that_files_error(tmp_path):
    """``export`` reads the run (``metrics.jsonl``, ``segments.jsonl``) inside its staged block, and a run exported
    beside itself lies under ``--out``'s folder: a file it could not read was reported as "cannot write --out"."""
    from trustbatch.recipes.outputs import staged_folder

    unreadable = tmp_path / "r1" / "metrics.jsonl"
    with pytest.raises(PermissionError):
        with staged_folder(tmp_path / "r1-export"):
            raise PermissionError(errno.EACCES, "Permission denied", str(unreadable))
    assert list(tmp_path.iterdir()) == []


def test_a_cache_whose_missing_parent_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    """A read-only home: the cache's missing parent cannot be made, and its error names that parent, above the
    cache folder; it escaped as a traceback."""
    from pathlib import Path

    from trustbatch.config import load_config
    from trustbatch.policy import model as policy_model
    from trustbatch.recipes import prepare_run

    from tiny import TINY

    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(ro / "x" / "cache"))
    real_mkdir, real_save = Path.mkdir, policy_model.Policy.save

    def mkdir(self, *a, **k):
        if ro in self.parents:  # what a read-only folder answers
            raise PermissionError(errno.EACCES, "Permission denied", str(ro / "x"))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(UserError, match=r"cannot write the base into the cache .*\(Permission denied\).*TRUSTBATCH"):
        prepare_run(load_config(None, TINY + ["reward.workers=0", "model.sft_steps=1"]))
    assert real_save is policy_model.Policy.save and list(ro.iterdir()) == []


def test_a_file_size_limit_is_told_only_by_a_file_written_since_the_writes_began(tmp_path, monkeypatch):
    """An old file at or over the limit beside an output (a model, a dataset) made any other failure there "File too
    large" (a reviewer's 250-character --out); only a file modified since the block began tells the limit now."""
    import os
    import time

    from trustbatch import records

    monkeypatch.setattr(records, "_file_size_limit", lambda: 1000)
    old = tmp_path / "big" / "old.safetensors"
    old.parent.mkdir()
    old.write_bytes(b"\0" * 4000)
    os.utime(old, (time.time() - 3600,) * 2)
    os.utime(old.parent, (time.time() - 3600,) * 2)
    since = time.time()
    assert records.write_failure(tmp_path, RuntimeError("unexpected pos 576 vs 534"), since) is None
    (tmp_path / "staged").mkdir()
    (tmp_path / "staged" / "trainer_state.pt").write_bytes(b"\0" * 1000)  # torn at the limit
    told = records.write_failure(tmp_path, RuntimeError("unexpected pos 576 vs 534"), since)
    assert told.errno == errno.EFBIG and "the file-size limit is 1000 bytes" in told.strerror
    # safetensors names the errno in its message (its error type is no OSError): the limit's, and any refused write's
    for raised, no in (("Error while serializing: I/O error: File too large (os error 27)", errno.EFBIG),
                       ("Error while serializing: I/O error: Read-only file system (os error 30)", errno.EROFS)):
        assert records.write_failure(tmp_path, RuntimeError(raised)).errno == no


def test_a_long_out_name_writes_or_is_one_line(tmp_path):
    """A legal 250-byte name was a traceback after the work (the temporary sibling's name passed 255 bytes); one past
    the file system's limit is refused before any work."""
    from trustbatch.recipes.evaluate import save_results
    from trustbatch.recipes.outputs import output_file, output_folder, staged_folder

    name = "r" * 245 + ".json"
    assert save_results({"average": {}}, output_file(tmp_path / name)).name == name
    with staged_folder(output_folder(tmp_path / ("e" * 250), create=False)) as tmp:
        (tmp / "README.md").write_text("x")
    assert (tmp_path / ("e" * 250) / "README.md").read_text() == "x"
    for check in (output_file, output_folder):
        with pytest.raises(UserError, match="has a name longer than the file system takes"):
            check(tmp_path / ("x" * 300))
