"""The folder a command writes to (``export --out``, ``report --out``), checked before any work: one line, not a
traceback, when it is a file, lies inside one, or cannot be created or written."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..errors import UserError


def output_folder(path: str | Path, flag: str = "--out", *, create: bool = True) -> Path:
    """Check that folder ``path`` can hold a command's output; returns it (``~`` expanded).

    ``create``: make ``path`` (with its parents) and try a file in it; else make only its parent and try a file
    there (``path`` then appears by a rename, as ``export`` writes it). Messages name ``path`` as ``flag``.

    Raises:
        UserError: ``path`` is a file or lies inside one; it (or its parent) cannot be created, or takes no file
            (permissions, a read-only or full disk, a folder of ``/proc``); the message gives the system's reason.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {str(p)!r} is a file, not a folder; give a folder")
    above = next(a for a in p.parents if a.exists())  # "." or "/" at worst
    if not above.is_dir():
        raise UserError(f"{flag} {str(p)!r} lies inside {str(above)!r}, which is a file; give a folder elsewhere")
    where = p if create else p.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise UserError(f"cannot write {flag} {str(p)!r} ({e.strerror or e}); give a folder you can write, or fix "
                        "its permissions or free disk space") from None
    return p
