"""Shared by tests/unit (no processes spawned) and tests/integration (processes, DDP, resume, lab, end to end).

Helpers that test files import (``tiny``, ``runproc``, ``grad_probe``, ``llama_rows``, ``scorers_for_tests``,
``lora_merge``, ``gloo_ranks``) live in tests/support, put on ``sys.path`` here; processes spawned by multiprocessing
inherit it, and tests that start a fresh interpreter put it on that process's PYTHONPATH (the
``support_on_pythonpath`` fixture).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data and models folder, beside the checkout (override with TRUSTBATCH_SHARED)."""
    p = Path(os.environ.get("TRUSTBATCH_SHARED", ROOT.parent / "shared"))
    if not p.is_dir():
        pytest.skip(f"shared folder {p} not found; set TRUSTBATCH_SHARED")
    return p


@pytest.fixture
def support_on_pythonpath(monkeypatch, request):
    """tests/support and the test's own folder on PYTHONPATH, for the fresh interpreters a test starts (trainer,
    rollout workers, Ray's workers, which unpickle functions defined in the test module by its name)."""
    here = str(Path(str(request.fspath)).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), here, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """The last lines of each failure, again, at the end of the log: CI keeps only the log's tail, and pytest's short
    summary gives only an error's first line (or, where `CI` is set, every line of every message), while a failed
    command's cause (a rank's signal, the trainer's one-line error) is at the end of the assertion's message.

    An outer wrapper (tryfirst), so this prints after the terminal reporter's own short summary."""
    result = yield
    _repeat_failure_ends(terminalreporter)
    return result


def _repeat_failure_ends(terminalreporter):
    reports = [r for kind in ("failed", "error") for r in terminalreporter.stats.get(kind, [])
               if getattr(r, "longrepr", None) is not None]
    if not reports:
        return
    terminalreporter.section("the end of each failure (also above, in full)")
    for r in reports[:6]:
        lines = [line for line in r.longreprtext.splitlines() if line.strip()]
        # the error's own lines ("E   ..."), without the introspection of the compared objects
        said = [line for line in lines if line.startswith("E ") and "+  where" not in line]
        tail = (said[-10:] + lines[-1:]) if said else lines[-12:]
        terminalreporter.write_line(f"{r.nodeid} ({r.when}):")
        for line in tail:
            terminalreporter.write_line(f"    {line[:300]}")
    if len(reports) > 6:
        terminalreporter.write_line(f"... and {len(reports) - 6} more, above")
