"""Two gloo ranks in spawned processes, for tests that compare a data-parallel step with one process.

Each rank ends through ``trustbatch.processes.exit_without_finalizing``, as a ``trustbatch`` torchrun rank does:
gloo's worker threads free a finished collective's tensors and need the GIL for it, and one that asked while the
spawned interpreter was finalising aborted a rank that had saved its results (SIGABRT, pytorch/pytorch#190489; CI
at stop 53 lost ``test_parallel``'s module fixture to it).
"""

import datetime
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from trustbatch.parallel import World
from trustbatch.processes import exit_without_finalizing


def _rank_main(rank: int, body, init_file: str, out_dir: str, finalize: bool) -> None:
    # a rank killed by a signal leaves no traceback; its stderr's last lines go into the parent's error instead,
    # the one line a CI log's summary keeps
    err = os.open(Path(out_dir) / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    # a collective that one rank never reaches fails after the timeout instead of hanging the test run
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(minutes=3))
    torch.set_num_threads(1)
    res = body(World.from_env(), Path(out_dir))
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
    if not finalize:
        exit_without_finalizing(0)  # an exception above takes multiprocessing's own path, which reports it


def two_gloo_ranks(body, out_dir: Path, finalize: bool = False) -> list:
    """``body(world, out_dir)`` (a module-level function) in two spawned gloo ranks; their results in rank order.

    ``finalize=True`` ends each rank as a plain spawned process does, through Python's finalisation: the control
    of ``bench/spawned_exit.py``.

    Raises:
        torch.multiprocessing.ProcessExitedException: a rank died (a signal, ``os._exit``); the message ends with
            the last lines that rank wrote to stderr.
        torch.multiprocessing.ProcessRaisedException: ``body`` raised in a rank (its traceback).
    """
    try:
        mp.start_processes(_rank_main, args=(body, str(out_dir / "init"), str(out_dir), finalize), nprocs=2,
                           start_method="spawn", join=True)
    except mp.ProcessExitedException as e:
        log = out_dir / f"rank{e.error_index}.stderr"
        said = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        raise mp.ProcessExitedException(f"{e}; its stderr ended: {' | '.join(said) or '(nothing)'}", e.error_index,
                                        getattr(e, "error_pid", None), e.exit_code, e.signal_name) from None  # torch 2.9: none
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
