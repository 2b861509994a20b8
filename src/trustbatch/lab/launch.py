"""Start lab runs as ``trustbatch train`` processes forked from a warm server, not as fresh interpreters.

A fresh ``python -m trustbatch train`` spends ~6 s of one core importing torch, transformers,
reasoning-gym, matplotlib and tensorboard before its first round (measured by ``bench/lab_launch.py``);
a lab experiment starts 24–42 runs. multiprocessing's forkserver imports those modules once in a server
process that never runs a tensor operation, and forks each run from it: every run is still its own
process (own memory, own seeds, killed alone), started with the imports already done.

A run is ``recipes.train.train_command`` under the CLI's own guard (``errors.exit_on_error``): the same one
line and exit code as ``trustbatch train`` for bad input or Ctrl-C, without the command-line app.

Why the server must not compute: a fork of a process whose OpenMP pool has run can deadlock in the
child. The server only imports; each child sets its own thread count (``threads`` in the run's config).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

from ..processes import die_with_sentinel

# what a ``trustbatch train`` run imports before its first round (the slow part of its start); a module that is
# not installed is skipped by the server (multiprocessing ignores an ImportError in the preload)
PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "reasoning_gym",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "trustbatch.recipes.train",
]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def train_arguments(argv: list[str]) -> dict:
    """``train_command``'s keyword arguments from ``trustbatch`` arguments ``["train", *args]``: ``--config FILE``,
    ``--resume RUN_DIR`` and ``key=value`` overrides, in any order, as ``trustbatch train`` takes them.

    Raises:
        ValueError: ``argv`` is not a ``train`` call (the lab starts nothing else).
        SystemExit: an unknown option (code 2, argparse's usage line on stderr), or ``--help`` (code 0).
    """
    if argv[:1] != ["train"]:
        raise ValueError(f"a lab run is a `trustbatch train` call, got `trustbatch {' '.join(argv)}`")
    parser = argparse.ArgumentParser(prog="trustbatch train", description="a lab run (lab.launch)")
    parser.add_argument("--config", "-c", help="YAML config file")
    parser.add_argument("--resume", help="continue the run in RUN_DIR from its last checkpoint")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_intermixed_args(argv[1:])
    return {"config": args.config, "overrides": args.overrides or None, "resume": args.resume}


def _train_main(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """The child: the caller's environment and directory, stdout and stderr (Python's and the C libraries') to
    ``log``, then ``trustbatch *argv`` (a ``train`` call) under the CLI's guard.

    The exit code is the CLI's: 0, 2 for bad input, 130 for Ctrl-C (``exit_on_error`` raises SystemExit, which
    multiprocessing turns into the exit code), 1 for a crash (its traceback in ``log``). The run exits when the
    process that launched it dies (SIGKILL included): its parent is the forkserver, which outlives the launcher
    while any run holds its pipe open, so the run watches the launcher itself (``processes.die_with_sentinel``)."""
    die_with_sentinel(multiprocessing.parent_process().sentinel)
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
    from ..errors import exit_on_error
    from ..recipes.train import train_command

    exit_on_error(lambda: train_command(**train_arguments(argv)))


class Run:
    """One ``trustbatch *argv`` process (``argv``: ``["train", ...]``) forked from the warm server, its output to
    ``log``.

    The subset of ``subprocess.Popen`` the runner uses: ``pid``, ``poll()``, ``returncode``, ``terminate()``,
    ``kill()``, ``wait(timeout)`` (raises ``TimeoutError`` when the process is still running after ``timeout``).
    """

    def __init__(self, argv: list[str], log: Path):
        args = (list(argv), str(Path(log).absolute()), dict(os.environ), os.getcwd())
        self._proc = _context().Process(target=_train_main, args=args, name=f"trustbatch {argv[0]}")
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
