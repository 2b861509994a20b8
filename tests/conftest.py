import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data and models folder, beside the checkout (override with TRUSTBATCH_SHARED)."""
    p = Path(os.environ.get("TRUSTBATCH_SHARED", ROOT.parent / "shared"))
    if not p.is_dir():
        pytest.skip(f"shared folder {p} not found; set TRUSTBATCH_SHARED")
    return p


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)
