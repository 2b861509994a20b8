"""How a torchrun rank ends: ``processes.exit_without_finalizing`` does what Python's exit does before it finalises
(joins the non-daemon threads and the thread pools' work, runs the ``atexit`` handlers, flushes stdout and stderr)
and skips the finalisation itself, whose last garbage collection is when a gloo worker thread asking for the GIL
aborted a finished rank (pytorch/pytorch#190489). ``cli.main`` takes that exit under torchrun only.

Each case has its control: the same process ended by ``sys.exit`` runs the finaliser that the tested exit skips.
The tests' own spawned gloo ranks (``tests/support/gloo_ranks.py``) end the same way, and one that dies is named
with its signal and its last lines of stderr.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

PROGRAM = '''
import atexit, concurrent.futures, sys, threading, time
sys.path.insert(0, {src!r})
from trustbatch.processes import exit_without_finalizing

out = {out!r}

def mark(what, open=open):  # bound now: a finaliser runs after the builtins are gone
    with open(out, "a") as f:
        f.write(what + "\\n")

class Finalised:  # held by the module: freed only when the interpreter finalises
    def __del__(self):
        mark("finaliser")

held = Finalised()
atexit.register(mark, "atexit")
threading.Thread(target=lambda: (time.sleep(0.3), mark("thread"))).start()
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: (time.sleep(0.3), mark("pool")))
sys.stdout.write("buffered")  # a pipe: block-buffered, not yet written
code = {code!r}
if sys.argv[1] == "sys.exit":
    sys.exit(code)
exit_without_finalizing(code)
'''


def _end(tmp_path, how: str, code) -> tuple[subprocess.CompletedProcess, list[str]]:
    out = tmp_path / f"{how}.marks"
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.format(src=str(SRC), out=str(out), code=code))
    p = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
    return p, sorted(out.read_text().split()) if out.exists() else []


@pytest.mark.parametrize("code, status", [(3, 3), (None, 0), (0, 0)])
def test_it_ends_as_sys_exit_does_less_the_finalisation(tmp_path, code, status):
    p, marks = _end(tmp_path, "exit_without_finalizing", code)
    assert p.returncode == status, p.stderr
    assert p.stdout == "buffered"
    assert marks == ["atexit", "pool", "thread"]
    control, control_marks = _end(tmp_path, "sys.exit", code)
    assert control.returncode == status and control.stdout == "buffered"
    assert control_marks == ["atexit", "finaliser", "pool", "thread"]


def test_a_message_goes_to_stderr_with_status_1_as_sys_exit_gives(tmp_path):
    p, marks = _end(tmp_path, "exit_without_finalizing", "cannot go on")
    control, _ = _end(tmp_path, "sys.exit", "cannot go on")
    assert (p.returncode, p.stderr.strip()) == (control.returncode, control.stderr.strip()) == (1, "cannot go on")
    assert "finaliser" not in marks


def test_the_command_skips_the_finalisation_under_torchrun_only(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marks = tmp_path / "marks"
    # loaded at start-up by every Python process with `site` on its path: an object freed only when Python finalises
    (site / "sitecustomize.py").write_text(
        "class Finalised:\n"
        "    def __del__(self, open=open):\n"
        f"        open({str(marks)!r}, 'a').write('finaliser\\n')\n"
        "held = Finalised()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(SRC)])}
    env.pop("TORCHELASTIC_RUN_ID", None)
    for rank in (False, True):
        if rank:
            env["TORCHELASTIC_RUN_ID"] = "test"  # what torchrun sets in each rank's environment
        marks.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-m", "trustbatch", "train", "train.no_such_key=1"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert p.returncode == 2, p.stderr  # the same exit status and one-line error either way
        assert p.stderr.startswith("trustbatch: error:") and "no_such_key" in p.stderr, p.stderr
        assert marks.exists() is not rank, rank


def _rank_number(world, out_dir: Path) -> int:
    return world.rank


def _rank_one_aborts(world, out_dir: Path) -> int:
    if world.rank == 1:
        print("rank 1 is about to abort", file=sys.stderr, flush=True)
        os.abort()
    return world.rank


def test_spawned_ranks_end_cleanly_and_a_dead_rank_is_named_with_its_signal_and_last_stderr(tmp_path):
    """The tests' spawned ranks (``tests/support/gloo_ranks.py``) exit 0 through ``exit_without_finalizing``, and a
    rank killed by a signal, which leaves no traceback, is reported with what it last wrote to stderr: the one line
    a CI log's summary keeps (CI at stop 53 showed only "process 1 terminated with signal SIGABRT")."""
    import torch.multiprocessing as mp
    from gloo_ranks import two_gloo_ranks

    (tmp_path / "ok").mkdir()
    assert two_gloo_ranks(_rank_number, tmp_path / "ok") == [0, 1]
    (tmp_path / "dies").mkdir()
    with pytest.raises(mp.ProcessExitedException, match=r"process 1 terminated with signal SIGABRT; its stderr ended: "
                                                        r".*rank 1 is about to abort") as e:
        two_gloo_ranks(_rank_one_aborts, tmp_path / "dies")
    assert (e.value.error_index, e.value.signal_name) == (1, "SIGABRT")
