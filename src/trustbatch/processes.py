"""Child processes that never outlive the trainer (reward workers, rollout workers)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_PARENT_CHECK_S = 1.0  # how often a child checks that its parent is alive
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be killed when the parent dies, and watch for it where the kernel cannot help.

    On Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``; it fires when the
    *thread* that started the child exits, so start children from a long-lived thread). Everywhere,
    a daemon thread checks ``getppid()`` every second and exits when the parent is gone.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:  # also covers a child stuck in user code while the parent is gone
        while True:
            time.sleep(_PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="trustbatch-parent-watch").start()
