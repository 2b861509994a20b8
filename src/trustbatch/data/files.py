"""Rows from the files people have: Parquet, JSON and saved ``datasets`` directories, read with Hugging Face ``datasets``.

``.parquet`` and ``.json`` files load with ``datasets.load_dataset`` (its ``json`` builder reads a JSON array of
objects and JSON Lines alike); a directory written by ``Dataset.save_to_disk`` loads with ``datasets.load_from_disk``
(a ``DatasetDict`` directory with one split is that split; with several, the split's own folder ``DIR/SPLIT`` is
given). JSON Lines (``.jsonl`` and any other suffix) stay with ``benchmarks._read_rows``, which names the line of a
bad row. ``load_dataset`` keeps an Arrow copy of each file in its cache (``HF_DATASETS_CACHE``, by default
``~/.cache/huggingface/datasets``), as it does for any local file.

Every failure is one ``UserError`` naming the file and the cause; the rows then go through the same format
detection and field mapping as JSONL rows (``benchmarks.to_example``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

from ..errors import UserError

TABLE_SUFFIXES = {".parquet": "parquet", ".json": "json"}  # file suffix -> datasets builder


def is_table(path: Path) -> bool:
    """Whether ``path`` is read here (a Parquet or JSON file, or a directory) rather than as JSON Lines."""
    return path.is_dir() or path.suffix.lower() in TABLE_SUFFIXES


def read_table(path: Path) -> list[tuple[str, dict]]:
    """``(where, row)`` for every row of a Parquet or JSON file or a saved ``datasets`` directory, ``where`` being
    ``"'PATH' row N"`` (1-based) for the messages of later checks.

    Raises:
        UserError: ``datasets`` is not installed; the file or directory cannot be read (not Parquet, not JSON,
            not a ``save_to_disk`` directory, a ``DatasetDict`` of several splits); it holds no rows. One line,
            naming the path and the cause.
    """
    datasets = import_datasets("Parquet, JSON and datasets directories", "; or give a JSONL file")
    shown = repr(str(path))
    with _quiet(datasets):
        try:
            ds = _load_dir(datasets, path) if path.is_dir() else datasets.load_dataset(
                TABLE_SUFFIXES[path.suffix.lower()], data_files=str(path), split="train")
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow, json and datasets raise many types: one line each
            raise UserError(f"cannot read {shown} as {_kind(path)}: {_cause(e)}; check the file "
                            f"({_fix(path)})") from None
    rows = ds.to_list()
    if not rows:
        raise UserError(f"{shown} holds no rows")
    return [(f"{shown} row {i}", r) for i, r in enumerate(rows, 1)]


def _load_dir(datasets, path: Path):
    if not any((path / f).exists() for f in ("state.json", "dataset_dict.json")):
        raise UserError(f"{str(path)!r} is a directory but not a saved datasets directory (no state.json or "
                        "dataset_dict.json); give one written by Dataset.save_to_disk, or a JSONL, JSON or Parquet file")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise UserError(f"{str(path)!r} holds the splits {', '.join(ds)}; give one split's folder, e.g. "
                            f"{str(path / next(iter(ds))) !r}")
        ds = next(iter(ds.values()))
    return ds


def import_datasets(need: str, otherwise: str = ""):
    """The ``datasets`` module, imported for ``need`` (what the caller reads with it, the subject of "need").

    ``otherwise`` ends the fix with what else a user may give ("; or give a JSONL file").

    Raises:
        UserError: it is not installed; or it is but fails to import (pyarrow 26 refuses NumPy 1.x, which pip does
            not know). One line with the cause and the fix.
    """
    try:
        import datasets
    except ImportError as e:
        if importlib.util.find_spec("datasets") is None:
            raise UserError(f"{need} need the `datasets` package: pip install datasets{otherwise}") from None
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{need} need the `datasets` package, which is installed but fails to import ({cause}): "
                        f"install what that names, e.g. pip install 'numpy>=2' for pyarrow 26{otherwise}") from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets):
    """No "Generating train split" progress bars or cache notices on stderr while one table loads."""
    from datasets.utils import logging as ds_logging

    bars, verbosity = datasets.is_progress_bar_enabled(), ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(ds_logging.CRITICAL)  # its "Failed to read schema" error line: ours says it
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _kind(path: Path) -> str:
    return "a saved datasets directory" if path.is_dir() else {"parquet": "Parquet", "json": "JSON"}[
        TABLE_SUFFIXES[path.suffix.lower()]]


def _fix(path: Path) -> str:
    if path.is_dir():
        return "save it again with Dataset.save_to_disk"
    if path.suffix.lower() == ".json":
        return "a JSON array of objects, or one JSON object per line"
    return "write it again, e.g. with pandas' to_parquet or Dataset.to_parquet"


def _cause(e: BaseException) -> str:
    """The innermost exception of ``e``'s chain, in one line (datasets wraps the reader's error in its own)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno}"
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1][:200] if lines else 'no message'}"
