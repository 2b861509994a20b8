"""tests/gpu: CUDA checks, marked ``gpu`` and skipped without CUDA (``make test-gpu``; not in ``make test``).

Every test collected under this folder gets the ``gpu`` marker here, and a skip when torch sees no CUDA device,
so ``pytest --collect-only tests/gpu`` lists them on a CPU and ``pytest tests/gpu`` skips them cleanly there.
"""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
