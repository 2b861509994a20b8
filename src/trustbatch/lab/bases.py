"""Which SFT base each archived run started from: ``bases.json`` beside an experiment's ``runs.tar.xz``.

A base build is deterministic on one machine, not across machines, so a re-run is a reproduction only on the same
base bytes, and a replicate otherwise. The bases themselves (about 3.6 MB each) are not committed: the records must
stay small (docs/lab3/bases.md). What is committed is each run's base key and the SHA-256 of its weights, so a later
run can say which of the two it is (``check_bases``). The bases stay in the cache that built them
(``$TRUSTBATCH_CACHE/base/{task}-{key}/``); a base store is that folder copied, and ``TRUSTBATCH_CACHE=STORE
trustbatch lab run ...`` makes the runs find them there before building any.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import load_config
from ..errors import UserError
from ..policy.base import base_key, cache_dir
from ..policy.shipped import file_sha256
from ..recipes.build import task_key
from . import records
from .report.runs import run_config

BASES = "bases.json"


def run_base(run_dir: Path) -> dict | None:
    """``{"task", "key", "sha256"}`` of the default base a finished run trained from (``sha256`` None when that base
    is not in this machine's cache); None for a run on a local model (``model.path``) or without a readable config."""
    path = run_dir.parent / f"{run_dir.name}.yaml"
    if not records.exists(path):
        return None
    raw = run_config(path)
    raw.pop("run_dir", None)
    try:
        cfg = load_config(None, base=raw)
    except UserError:  # a config of keys this version no longer reads: its base cannot be named here
        return None
    if cfg.model.path:
        return None
    task = task_key(cfg)
    key = base_key(task, cfg.model.model_dump(mode="json"))
    weights = cache_dir() / "base" / f"{task['name']}-{key}" / "model.safetensors"
    return {"task": task["name"], "key": key, "sha256": file_sha256(weights) if weights.is_file() else None}


def experiment_bases(exp_dir: Path) -> dict[str, dict]:
    """``{"ARM/seedK": run_base}`` over the finished runs of ``exp_dir`` (on disk or packed)."""
    out = {}
    for run in records.finished_runs(exp_dir):
        base = run_base(run)
        if base is not None:
            out[f"{run.parent.name}/{run.name}"] = base
    return out


def write_bases(exp_dir: Path, dest: Path) -> int:
    """Write ``dest/bases.json`` from ``exp_dir``'s runs (kept as it is where ``exp_dir`` already holds one: an
    archived folder's hashes came from the machine that built its bases); none when no run trained from a default
    base. Returns the bytes written."""
    src = Path(exp_dir) / BASES
    if src.is_file():
        text = src.read_text()
    else:
        bases = experiment_bases(exp_dir)
        if not bases:  # no run on a default base: nothing to name
            return 0
        text = json.dumps(bases, indent=1, sort_keys=True)
    (Path(dest) / BASES).write_text(text)
    return len(text.encode())


def check_bases(archived: Path, rerun: Path) -> dict[str, str]:
    """For each run of ``rerun`` that ``archived/bases.json`` lists: ``"reproduction"`` (same base key and weights),
    ``"replicate"`` (another base) or ``"unknown"`` (no hash on one side)."""
    listed = json.loads((Path(archived) / BASES).read_text())
    out = {}
    for name, now in experiment_bases(rerun).items():
        then = listed.get(name)
        if then is None:
            continue
        if then["sha256"] is None or now["sha256"] is None:
            out[name] = "unknown"
        else:
            same = then["key"] == now["key"] and then["sha256"] == now["sha256"]
            out[name] = "reproduction" if same else "replicate"
    return out
