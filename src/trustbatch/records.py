"""Records on disk, torch-free: atomic file writes and JSONL records (one JSON object a line, a ``step`` in each).

Readers skip a line that does not parse: a run killed mid-write leaves at most its last line torn.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path


def git_commit() -> str:
    """The short commit of the trustbatch checkout this code runs from, or ``"unknown"`` (no git, an installed copy)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, then rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def truncate_records(path: Path, step: int) -> None:
    """Drop the JSONL records of ``path`` past ``step`` and any torn line (a resume redoes those rounds)."""
    path = Path(path)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) <= step:
            keep.append(line)
    atomic_write(path, "".join(k + "\n" for k in keep))


def iter_metrics(path: Path):
    """The JSONL records of ``path`` one at a time, skipping lines that do not parse (a torn last write)."""
    with open(path) as f:
        yield from parse_records(f)


def parse_records(lines):
    """The JSON records of an iterable of JSONL lines one at a time, skipping lines that do not parse."""
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            pass


def read_metrics(path: Path) -> list[dict]:
    """All the JSONL records of ``path`` that parse, in order (``iter_metrics`` as a list).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    return list(iter_metrics(path))
