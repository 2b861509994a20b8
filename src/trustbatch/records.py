"""Records on disk, torch-free: atomic file writes and JSONL records (one JSON object a line, a ``step`` in each).

Readers skip a line that does not parse: a run killed mid-write leaves at most its last line torn.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .errors import UserError

try:
    import resource  # a file-size limit (ulimit -f) is a POSIX rlimit
except ImportError:  # Windows
    resource = None

FULL_DISK_BYTES = 64 << 20  # below this much free space a failed write is taken as a full disk
# what a refused write's OSError says: a full disk or quota, a file-size limit, a read-only disk, no permission
_REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def write_failure(root: Path, e: BaseException, since: float | None = None) -> OSError | None:
    """The OSError behind a failed write into folder ``root``, or None when ``root`` still takes files (another fault).

    An OSError of a refused write is itself; torch.save on a full disk raises RuntimeError ("unexpected pos",
    "PytorchStreamWriter failed writing") and safetensors its SafetensorError: named as the OSError they wrap, which
    safetensors' message gives ("... (os error 27)"). Else a full disk is told by its free space (a small file may
    still fit), a file-size limit (``ulimit -f``, which an empty probe file passes) by a file under ``root`` written
    since ``since`` (``time.time()`` when the writes began; None: not looked for) that reached it, anything else by
    trying to create a file in ``root``.
    """
    if isinstance(e, OSError) and e.errno in _REFUSED:
        if not isinstance(e.filename, str):
            return e
        name, folder = Path(os.path.abspath(e.filename)), Path(os.path.abspath(root))
        return e if name == folder or folder in name.parents else None  # else another file's (a read): not ours
    if not isinstance(e, (OSError, RuntimeError)) and type(e).__name__ != "SafetensorError":
        return None
    told = re.search(r"\(os error (\d+)\)", str(e))
    if told and int(told[1]) in _REFUSED:
        return _too_large(root) if int(told[1]) == errno.EFBIG else OSError(int(told[1]), os.strerror(int(told[1])),
                                                                              str(root))
    with contextlib.suppress(OSError):
        if shutil.disk_usage(root).free < FULL_DISK_BYTES:
            return OSError(errno.ENOSPC, f"no space left ({str(e).splitlines()[0][:120] if str(e) else e!r})",
                           str(root))
    limit = _file_size_limit()
    if limit is not None and since is not None and _largest_new_file(Path(root), since) >= limit:
        return _too_large(root)
    try:
        tempfile.TemporaryFile(dir=root).close()
    except OSError as probe:
        return OSError(probe.errno, probe.strerror, str(root))  # the folder, not the probe's random name
    return None


def _file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``, RLIMIT_FSIZE), or None for none."""
    if resource is None:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def _too_large(root: Path) -> OSError:
    limit = _file_size_limit()
    said = f" (the file-size limit is {limit} bytes: ulimit -f)" if limit is not None else ""
    return OSError(errno.EFBIG, os.strerror(errno.EFBIG) + said, str(root))


def _largest_new_file(root: Path, since: float) -> int:
    """The size in bytes of the largest file under folder ``root`` modified since ``since`` (0 for none). Only
    folders modified since then are entered (a file made in one changes it): an old file of the user's beside an
    output, or a large tree under it, is neither counted nor walked."""
    since -= 2  # file systems that keep coarse modification times (FAT: 2 s)
    sizes, todo = [0], [str(root)]
    while todo:
        with contextlib.suppress(OSError), os.scandir(todo.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_mtime < since:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        sizes.append(st.st_size)
    return max(sizes)


@contextlib.contextmanager
def refused_write(root: Path, what: str, fix: str):
    """Run a block that writes into folder ``root``; a write the disk refuses (full, read-only, no permission, a
    file-size limit) ends as one ``UserError``: "cannot write WHAT (reason); FIX" (for a file-size limit: raise it).
    Any other error passes as it is.
    """
    since = time.time()
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        cause = write_failure(root, e, since)
        if cause is None:
            raise
        if cause.errno == errno.EFBIG:
            fix = "raise the file-size limit (ulimit -f)"
        raise UserError(f"cannot write {what} ({cause.strerror or cause}); {fix}") from None


def git_commit() -> str:
    """The short commit of the trustbatch checkout this code runs from, or ``"unknown"`` (no git, an installed copy)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def package_version() -> str:
    """The installed trustbatch's version (its metadata), or ``"unknown"`` for a source tree never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trustbatch")
    except PackageNotFoundError:
        return "unknown"


def umask() -> int:
    """The process's file-mode creation mask (e.g. ``0o022``).

    Linux shows it in /proc; elsewhere it can only be read by setting it, which another thread could see for an
    instant (files it creates then get mode 0666 & the new mask), so it is set to itself at once.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(root: Path) -> None:
    """Give ``root`` and everything under it the modes ``open`` and ``mkdir`` give under the umask (0644 and 0755
    under 022), before it is renamed into place (a checkpoint, an export, a cached base) where others of the team
    must read it: ``tempfile.mkdtemp`` makes 0700, and safetensors 0.8 writes 0600 (through a temporary file)."""
    mask = umask()
    for path in (Path(root), *Path(root).rglob("*")):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, then rename: readers see old or new, never half.

    The file gets the mode a plain ``open`` gives (0644 under umask 022), not ``mkstemp``'s 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name near the file system's limit (255 bytes) stays within it with the temporary file's additions
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def truncate_records(path: Path, step: int, key: str = "step") -> None:
    """Drop the JSONL records of ``path`` past ``step`` and any torn line (a resume redoes those rounds); ``key``:
    the field that holds a record's round (``step`` where a record lacks it: a file from before the field)."""
    path = Path(path)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get(key, rec.get("step", 0)) <= step:
            keep.append(line)
    atomic_write(path, "".join(k + "\n" for k in keep))


def iter_metrics(path: Path):
    """The JSONL records of ``path`` one at a time, skipping lines that do not parse (a torn last write; bytes that
    are no UTF-8 are replaced, and the line then fails to parse or keeps its other fields)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from parse_records(f)


def parse_records(lines):
    """The JSON records of an iterable of JSONL lines one at a time, skipping lines that do not parse and records
    that are no JSON object or whose ``step`` is no integer (nothing trustbatch wrote)."""
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step", 0), int):
            yield rec


def read_metrics(path: Path) -> list[dict]:
    """All the JSONL records of ``path`` that parse, in order (``iter_metrics`` as a list).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    return list(iter_metrics(path))
