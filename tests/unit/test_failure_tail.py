"""tests/conftest.py repeats the end of each failure after pytest's report: CI keeps only the log's tail."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

FAILING = '''
import subprocess, sys

def test_a_command_fails():
    p = subprocess.run([sys.executable, "-c", "import sys; print('noise\\\\n' * 40 + 'the real cause', file=sys.stderr); "
                        "sys.exit(3)"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]

def test_passes():
    pass
'''


@pytest.mark.parametrize("ci", [False, True], ids=["local", "CI-set"])
def test_the_log_ends_with_the_last_lines_of_a_failed_commands_message(tmp_path, ci):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(FAILING)
    # pytest prints every line of a failure's message in its short summary where CI or BUILD_NUMBER is set, which
    # is how CI runs, and only the first line elsewhere; the repeated ends must close the log in both
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    if ci:
        env["CI"] = "1"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout[-2000:]
    lines = p.stdout.splitlines()
    assert "FAILED test_inner.py::test_a_command_fails - AssertionError: noise" in p.stdout
    short = p.stdout.split("short test summary info")[1].split("the end of each failure")[0]
    assert ("the real cause" in short) == ci, "pytest's short summary changed: " + short[-1000:]
    start = next(i for i, line in enumerate(lines) if "the end of each failure" in line)
    section = lines[start:]
    # only pytest's closing count ("1 failed, 1 passed in ...") comes after the repeated ends
    assert len(section) < 20 and "1 failed, 1 passed" in section[-1], p.stdout[-2000:]
    assert any(line.strip() == "E         the real cause" for line in section), "\n".join(section)
    assert not any("+  where" in line for line in section), "\n".join(section)
    assert not any("test_passes" in line for line in section)
