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
