"""Start lab runs as ``trustbatch`` CLI processes forked from a warm server, not as fresh interpreters.

A fresh ``python -m trustbatch train`` spends ~6 s of one core importing torch, transformers,
reasoning-gym, matplotlib and tensorboard before its first round (measured by ``bench/lab_launch.py``);
a lab experiment starts 24–42 runs. multiprocessing's forkserver imports those modules once in a server
process that never runs a tensor operation, and forks each run from it: every run is still its own
process (own memory, own seeds, killed alone), started with the imports already done.

Why the server must not compute: a fork of a process whose OpenMP pool has run can deadlock in the
child. The server only imports; each child sets its own thread count (``threads`` in the run's config).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

# what a ``trustbatch train`` run imports before its first round (the slow part of its start); a module that is
# not installed is skipped by the server (multiprocessing ignores an ImportError in the preload)
PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "reasoning_gym",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "trustbatch.cli",
    "trustbatch.recipes.train",
]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _cli_main(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """The child: the caller's environment and directory, stdout and stderr (Python's and the C libraries') to
    ``log``, then ``trustbatch *argv``.

    The exit code is the CLI's (typer raises SystemExit, which multiprocessing turns into the exit code)."""
    # the server holds the environment and directory of the moment it started; a run gets its launcher's own
    # one thread per run, as the runner's jobs are one per core: torch's and numpy's thread pools are sized on first
    # use, after the fork (a run's config sets torch's own count again)
    os.environ.clear()
    os.environ.update(env, OMP_NUM_THREADS="1")
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["trustbatch", *argv]
    from trustbatch.cli import app

    app()


class Run:
    """One ``trustbatch *argv`` process forked from the warm server, its output to ``log``.

    The subset of ``subprocess.Popen`` the runner uses: ``pid``, ``poll()``, ``returncode``, ``terminate()``,
    ``kill()``, ``wait(timeout)`` (raises ``TimeoutError`` when the process is still running after ``timeout``).
    """

    def __init__(self, argv: list[str], log: Path):
        args = (list(argv), str(Path(log).absolute()), dict(os.environ), os.getcwd())
        self._proc = _context().Process(target=_cli_main, args=args, name=f"trustbatch {argv[0]}")
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
        return self._proc.exitcode
