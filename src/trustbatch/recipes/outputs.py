"""Where a command writes (``export``, ``report`` and ``sft --out`` folders, ``eval --out`` files), checked before any
work: one line, not a traceback, when a folder is a file or a file a folder, it lies inside a file, or cannot be
created or written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError
from ..records import refused_write, umask_modes


def output_folder(path: str | Path, flag: str = "--out", *, create: bool = True) -> Path:
    """Check that folder ``path`` can hold a command's output; returns it (``~`` expanded).

    ``create``: make ``path`` (with its parents) and try a file in it; else make only its parent and try a file
    there (``path`` then appears by a rename, as ``export`` writes it). Messages name ``path`` as ``flag``.

    Raises:
        UserError: ``path`` is a file or lies inside one; it (or its parent) cannot be created, or takes no file
            (permissions, a read-only or full disk, a folder of ``/proc``); the message gives the system's reason.
    """
    p = _fitting(Path(path).expanduser(), flag)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {str(p)!r} is a file, not a folder; give a folder")
    _writable(p, p if create else p.parent, flag, "a folder")
    return p


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """Check that file ``path`` can be written: a file can be made in its folder, or in the nearest folder above it
    that exists (nothing is created here); returns it (``~`` expanded).

    Raises:
        UserError: ``path`` is a folder or lies inside a file; its folder cannot be created, or takes no file; the
            message gives the system's reason.
    """
    p = _fitting(Path(path).expanduser(), flag)
    if p.is_dir():
        raise UserError(f"{flag} {str(p)!r} is a folder, not a file; give a file path such as "
                        f"{str(p / 'results.json')!r}")
    _writable(p, None, flag, "a path")
    return p


def _fitting(p: Path, flag: str) -> Path:
    """``p``, or one line when a name in it is longer than the file system takes (``stat`` itself refuses it)."""
    longest = 255  # NAME_MAX of Linux's and macOS's file systems
    with contextlib.suppress(OSError, ValueError, AttributeError):
        longest = os.pathconf(next((a for a in p.parents if os.path.isdir(a)), "."), "PC_NAME_MAX")
    if any(len(os.fsencode(part)) > longest for part in p.parts):
        raise UserError(f"{flag} {str(p)!r} has a name longer than the file system takes ({longest} bytes); give a "
                        "shorter name")
    return p


def _writable(p: Path, where: Path | None, flag: str, what: str) -> None:
    """Make folder ``where`` (holding or being ``p``) and write a temporary file in it (``where`` None: in the nearest
    existing folder above ``p``, making nothing), or say in one line why not."""
    above = next(a for a in p.parents if a.exists())  # "." or "/" at worst
    if not above.is_dir():
        raise UserError(f"{flag} {str(p)!r} lies inside {str(above)!r}, which is a file; give {what} elsewhere")
    try:
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=where or above).close()
    except OSError as e:
        raise UserError(f"cannot write {flag} {str(p)!r} ({e.strerror or e}); give {what} you can write, or fix "
                        "its permissions or free disk space") from None


def refused_output(dest: Path, flag: str = "--out", root: Path | None = None):
    """``records.refused_write`` for a command's output ``dest``, written in folder ``root`` (default: ``dest``'s
    folder): a write the disk refuses there is one line naming ``dest``."""
    return refused_write(Path(dest).parent if root is None else root, f"{flag} {str(dest)!r}",
                         f"free disk space there, fix its permissions or give another {flag}")


@contextlib.contextmanager
def staged_folder(dest: Path, flag: str = "--out"):
    """A temporary folder beside ``dest`` (absent or empty), renamed to ``dest`` with the umask's modes when the block
    ends, removed when it raises: nobody ever sees a half-written ``dest``. A write the disk refuses (full, read-only,
    no permission) ends as one ``UserError`` naming ``flag`` (``refused_output``).

    Raises:
        UserError: the disk refused a write of the block or of the rename.
    """
    with refused_output(dest, flag):
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name[:64]}.tmp-", dir=dest.parent))  # within the name limit
    try:
        # refused writes into the staged folder only: the block also reads (a run's records, a checkpoint), and a
        # file it cannot read is that file's error, not --out's
        with refused_output(dest, flag, root=tmp):
            yield tmp
            if dest.exists():
                dest.rmdir()
            umask_modes(tmp)
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
