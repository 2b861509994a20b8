"""The run directory: one run per directory (an exclusive lock), and what a resume may change.

The lock is ``RUN_DIR/.lock``, held with ``flock`` for the life of the process and holding the owner's
pid: the kernel releases it when the owner dies (kill -9 included), so a stale lock never blocks a
resume, while a live owner always refuses a second run on the same directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from .. import objectives
from ..config import Config, DataConfig, RolloutConfig, TaskConfig, TrainConfig
from ..config.load import FREE_FORM
from ..errors import UserError
from ..records import git_commit, package_version
from ..trainer.checkpoint import checkpoints
from ..trainer.runlog import MetricsLog

# Keys a resume may change: how long to run and how often to report, not what the run computes.
RESUMABLE_KEYS = ("train.steps", "eval.every", "checkpoint_every", "checkpoint_keep",
                  "checkpoint_keep_best", "threads", "reward.workers", "reward.timeout_s",
                  "run_dir", "log.trackers", "log.samples.every", "log.samples.train", "log.samples.heldout")

# errno values that mean "this path cannot be written": a full or read-only disk anywhere, and
# permissions / not a folder / no such parent when the path is the run directory, inside it or above it
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}  # EFBIG: a file-size limit (ulimit -f)
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ENOENT}


def run_dir_write_error(e: OSError, run_dir: Path) -> bool:
    """Whether ``e`` means the run directory cannot be written (the run then ends on one line, not a traceback)."""
    if e.errno in _DISK_FULL:
        return True
    if e.errno not in _PATH_ERRNOS or not e.filename:
        return False
    f, r = Path(os.path.abspath(e.filename)), Path(os.path.abspath(run_dir))
    return f == r or r in f.parents or f in r.parents


class RunLock:
    """An exclusive lock on a run directory. Use as a context manager.

    Raises:
        UserError: another live process holds the directory (its pid is named).
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"run directory {str(self.path.parent)!r} is in use by process {owner}; "
                            "wait for it to finish or give another run_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def make_new(run_dir: Path, default_name: bool) -> tuple[Path, bool]:
    """A new run's directory and whether this call made it (an exclusive ``mkdir``: two starts never both think they
    made one folder, so the one refused by the other's lock never removes it).

    ``default_name`` (no ``run_dir`` given): the folder is this start's alone, ``run_dir`` itself or ``run_dir-2``,
    ``-3``, ... when another start took the name (runs launched in the same second share the timestamp). A given
    ``run_dir`` that exists is used as it is (the lock and the resume checks decide).

    Raises:
        OSError: the folder cannot be made (``train`` reports a path that cannot be written in one line).
    """
    path, n = Path(run_dir), 1
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            path.mkdir()
            return path, True
        except FileExistsError:
            if not default_name:
                return path, False
            n += 1
            path = Path(f"{run_dir}-{n}")


def set_aside(run_dir: Path) -> Path:
    """Move everything in ``run_dir`` but its lock into a new subfolder ``interrupted-YYYYmmdd-HHMMSS`` (and earlier
    such subfolders stay where they are), so that a start interrupted before its first checkpoint can start over in
    the same directory without losing its records. Returns the subfolder. The caller holds the ``RunLock``."""
    dest = _unused(run_dir / f"interrupted-{time.strftime('%Y%m%d-%H%M%S')}")
    dest.mkdir()
    for p in sorted(run_dir.iterdir()):
        if p.name != ".lock" and not p.name.startswith("interrupted-"):
            os.replace(p, dest / p.name)
    return dest


def set_aside_unloadable(run_dir: Path, resumed: Path) -> list[tuple[Path, Path]]:
    """Rename the checkpoints newer than ``resumed`` (each failed to load: ``load_latest`` fell back past it) to
    ``checkpoints/unloadable-step_XXXXXX``; returns the ``(old, new)`` paths. Kept, for a look, but out of
    ``checkpoints``: the rotation counted them, kept a torn one and deleted the intact one a resume started from."""
    moved = []
    for ckpt in checkpoints(run_dir):
        if ckpt.name > resumed.name:
            dest = _unused(ckpt.with_name(f"unloadable-{ckpt.name}"))
            os.replace(ckpt, dest)
            moved.append((ckpt, dest))
    return moved


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``-3``, ... : the first that does not exist."""
    dest, n = path, 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}-{n}")
    return dest


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in FREE_FORM:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def as_read_now(saved: dict) -> dict:
    """A run's saved config (``config.yaml``, as a dict) as this version reads it, in place: a key added since the
    run started gets the value that reproduces what that run computed, and a value this version refuses because
    nothing reads it (it did nothing then either) goes back to its default, so an older run still resumes and
    exports (``train._resolve_run``, ``export``).

    - ``task.heldout_reserve`` 0: the base's SFT skipped the held-out prompts alone.
    - ``data.prompt_column`` false: a format row's question and instruction were its prompt.
    - ``rollout.prompt_order`` random: prompts were drawn at random with replacement.
    - ``objective.std`` population under ``advantage`` mean or rloo (no σ); ``data.*`` size and format keys without
      ``data.train`` (the task's own ran), and ``task.*`` with it (the file ran); ``rollout.quantization`` on the
      transformers engine (vLLM's alone); ``train.minibatches`` above a round's completions: that many (its other
      steps had no rows); ``rollout.max_sampling_rounds`` without dynamic sampling, ``rollout.foreign_model``
      without ``foreign_fraction``, ``ray_*`` with the local orchestrator, ``train.ess_scope`` under an objective
      that measures no ESS.
    """
    task, ro, obj, data = (saved.get(k) if isinstance(saved.get(k), dict) else {} for k in
                           ("task", "rollout", "objective", "data"))
    if task:
        task.setdefault("heldout_reserve", 0)
    if ro:
        ro.setdefault("prompt_order", "random")
        if ro.get("engine", "transformers") == "transformers":
            ro["quantization"] = None
    if obj.get("advantage") in ("mean", "rloo"):
        obj["std"] = "population"
    if data and not data.get("train"):
        for k in ("train_size", "heldout_size", "dir", "format", "prompt_field", "answer_field", "prompt_column"):
            data[k] = DataConfig.model_fields[k].default
    if data.get("train") and task:
        saved["task"] = TaskConfig().model_dump(mode="json")
    if data.get("train"):
        data.setdefault("prompt_column", False)
    train = saved.get("train") if isinstance(saved.get("train"), dict) else {}
    _unread_to_default(saved, ro, obj, train)
    rows = int(ro.get("prompts_per_step", 64)) * int(ro.get("group_size", 8)) if ro else None
    if rows and isinstance(train.get("minibatches"), int) and train["minibatches"] > rows:
        train["minibatches"] = rows  # the steps such a run took with rows (the empty ones are no longer taken)
    return saved


def _unread_to_default(saved: dict, ro: dict, obj: dict, train: dict) -> None:
    # keys set where their option was off: no run read them, and this version refuses them (config.sections)
    if ro and not ro.get("dynamic_sampling"):
        ro["max_sampling_rounds"] = RolloutConfig.model_fields["max_sampling_rounds"].default
    if ro and not ro.get("foreign_fraction"):
        ro["foreign_model"] = RolloutConfig.model_fields["foreign_model"].default
    if saved.get("orchestrator", "local") == "local":
        for k in ("ray_address", "ray_learners"):
            saved[k] = Config.model_fields[k].default
    name = obj.get("name", "p3o")
    if train and name in objectives.names() and not objectives.spec(name).batch_stats:
        train["ess_scope"] = TrainConfig.model_fields["ess_scope"].default


def check_resume_changes(saved: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """The dotted keys whose value differs between the saved and the resumed config (all allowed).

    A key the saved config lacks (added to trustbatch after the run started) is no change when the
    resumed value is that key's default: new keys default to what the code did before they existed.

    Raises:
        UserError: a key outside ``RESUMABLE_KEYS`` changes (the message names it and what may change).
    """
    a, b, d = _flat(saved), _flat(new), _flat(defaults or {})
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                     and not (k not in a and k in d and b.get(k) == d[k]))
    refused = [k for k in changed if k not in RESUMABLE_KEYS]
    if refused:
        raise UserError(f"--resume cannot change {refused[0]} ({a.get(refused[0])!r} -> {b.get(refused[0])!r}): it "
                        f"changes what the run computes; start a new run instead (a resume may change "
                        f"{', '.join(RESUMABLE_KEYS)})")
    return changed


# Keys whose value may be a local path; config.yaml keeps it as typed, relative to the directory the run started in
PATH_KEYS = ("model.path", "model.reference", "data.train", "data.heldout", "data.dir", "reward.model",
             "rollout.foreign_model")


def start_directory(run_dir: Path) -> str | None:
    """The directory the run started in (the ``cwd`` of the first line of ``segments.jsonl``), which the relative
    paths of its config are relative to; None for runs from before it was recorded."""
    seg = Path(run_dir) / "segments.jsonl"
    try:
        return json.loads(seg.read_text().splitlines()[0]).get("cwd") if seg.is_file() else None
    except (IndexError, json.JSONDecodeError, AttributeError):
        return None


def check_resume_paths(saved: dict, run_dir: Path) -> None:
    """Refuse a resume whose relative paths would name other files than the run's: the saved config keeps paths as
    typed, so from another directory ``data.train=../data/train.jsonl`` names nothing (or another file), and an
    absolute path in its place is a change a resume may not make. The run's start directory is the ``cwd`` of the
    first line of ``segments.jsonl`` (runs from before it recorded one are not checked).

    Raises:
        UserError: a relative path of ``PATH_KEYS`` exists from the start directory and, from here, does not or is
            another file; the line names the key, the start directory and the command to resume from there.
    """
    start = start_directory(run_dir)
    if not start or Path(start).resolve() == Path.cwd().resolve():
        return
    flat = _flat(saved)
    for key in PATH_KEYS:
        v = flat.get(key)
        if not isinstance(v, str) or os.path.isabs(os.path.expanduser(v)) or not (Path(start) / v).exists():
            continue
        if Path(v).exists() and Path(v).resolve() == (Path(start) / v).resolve():
            continue
        here = "is another file from here" if Path(v).exists() else "does not exist from here"
        raise UserError(f"cannot resume {str(run_dir)!r} from {os.getcwd()}: its {key}={v!r} is relative to {start}, "
                        f"where the run started, and {here}; resume from there: cd {start} && trustbatch train "
                        f"--resume {os.path.abspath(run_dir)}")


def record_segment(run_dir: Path, start_round: int, rounds: int, changed: dict) -> None:
    """Append one line per run segment (start, resume) to ``segments.jsonl``: when, from where, what changed, and
    the trustbatch commit and version that ran it (``records.git_commit``, ``records.package_version``; the model
    card of ``trustbatch export`` names them)."""
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid(), "start_round": start_round,
           "rounds": rounds, "changed": changed, "commit": git_commit(), "version": package_version(),
           "cwd": os.getcwd()}  # what the config's relative paths are relative to (check_resume_paths)
    with open(Path(run_dir) / "segments.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def open_metrics_log(cfg: Config, run_dir: Path, resume_round: int | None, enabled: bool = True) -> MetricsLog:
    """``metrics.jsonl`` with the trackers of ``log.trackers``, fed the config as ``config.yaml`` holds it; a resume
    (``resume_round``: the round of the checkpoint it starts from, -1 for none; None: a new run) cuts the records back
    to it and continues the trackers' runs, made to agree with the record (``MetricsLog.open``). ``enabled=False``
    (data-parallel ranks other than 0) opens nothing.

    Raises:
        UserError: a tracker whose package is not installed.
    """
    if not enabled:
        return MetricsLog(run_dir, enabled=False)
    config = cfg.model_copy(update={"run_dir": str(run_dir)}).model_dump(mode="json")
    return MetricsLog.open(run_dir, cfg.log.trackers, config, resume_round=resume_round,
                           mlflow_uri=cfg.log.mlflow_uri)
