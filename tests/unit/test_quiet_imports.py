"""The first import of reasoning-gym after an install that did not precompile bytecode (uv's default) prints no
SyntaxWarning of its dependencies before trustbatch's own output."""

import os
import subprocess
import sys

import pytest


def _stderr(code: str, tmp_path) -> str:
    # an empty bytecode cache, never written: every module is compiled from source, as on a first import
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr


def test_reasoning_gym_imports_without_its_dependencies_syntax_warnings(tmp_path):
    if "SyntaxWarning" not in _stderr("import reasoning_gym", tmp_path):
        pytest.skip("reasoning-gym's dependencies compile without SyntaxWarnings now")
    err = _stderr("from trustbatch.data.tasks import load_task; load_task('chain_sum', train_size=2, heldout_size=1, "
                  "seed=0)", tmp_path)
    assert "SyntaxWarning" not in err, err[-2000:]
