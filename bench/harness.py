"""The benchmarks' small harness: interleaved arms, median and range, the load they ran under, one JSON line per arm.

    from harness import interleave, record
    times = interleave({"full": run_full, "chunked": run_chunked}, repeats=5)
    record("logprob_memory", {arm: {"s": ts} for arm, ts in times.items()}, extra={...})

Arms run round-robin (a, b, a, b, ...) so that a slow spell of the machine hits every arm alike; ``rotate=True``
starts each round at the next arm (a, b; b, a; ...), for arms whose order matters (a cache warmed by the one before).
Each arm's line gives the median, min and max of its samples, the 1-minute load average when the script started
(``load_1min_start``) and when it recorded (``load_1min``), the commit, the machine and the date; the lines are
printed and appended to ``bench/results/<bench>.jsonl`` (``--no-save``, from ``options``: printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).parent / "results"


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# taken when a script imports the harness, before its first measurement
LOAD_AT_START = _load()


def options(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the harness's own flag to a script's parser: ``--no-save`` (print the JSON lines, append nothing)."""
    ap.add_argument("--no-save", action="store_true", help="print only; do not append to bench/results")
    return ap


def interleave(arms: dict[str, Callable[[], float | None]], repeats: int, warmup: int = 1,
               rotate: bool = False) -> dict[str, list[float]]:
    """Run ``warmup`` rounds (discarded), then ``repeats`` rounds of one call of every arm, in turn.

    An arm returns its own measurement (seconds, bytes...) or None to be timed by the harness (wall seconds).
    ``rotate``: round r (warm-up rounds counted) starts at arm r mod the number of arms.
    """
    names = list(arms)
    out: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(warmup + repeats):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            t = time.perf_counter()
            v = arms[name]()
            if r >= warmup:
                out[name].append(time.perf_counter() - t if v is None else float(v))
    return out


def summary(values: list[float]) -> dict[str, float]:
    """Median, min, max and count of a sample."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> str:
    """CPU model and core count, and the GPU when torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    except ImportError:
        pass
    return desc


def record(bench: str, arms: dict[str, dict], extra: dict | None = None, save: bool = True) -> list[dict]:
    """Print one JSON line per arm and append them to ``bench/results/<bench>.jsonl``.

    ``arms`` maps an arm to its fields; a list of numbers in a field becomes its ``summary``.
    """
    stamp = {"bench": bench, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
             "machine": machine(), "load_1min_start": LOAD_AT_START, "load_1min": _load(), **(extra or {})}
    lines = []
    for arm, fields in arms.items():
        line = {**stamp, "arm": arm}
        for k, v in fields.items():
            line[k] = summary(v) if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v) else v
        lines.append(line)
        print(json.dumps(line), flush=True)
    if save:
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / f"{bench}.jsonl", "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return lines
