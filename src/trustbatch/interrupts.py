"""Ctrl-C and SIGTERM that always end a run, whatever its main thread is doing when they arrive.

CPython turns SIGINT into ``KeyboardInterrupt`` in the main thread at its next bytecode, which misses in two ways that
a long run meets: the exception is raised inside a finalizer (``__del__``, a weakref or GC callback), where it is
printed as "Exception ignored" and dropped; or the kernel hands the signal to another thread (a tracker's writer),
and a main thread already asleep in a blocking call (a scorer's ``time.sleep``, a lock) is never woken. Either way the
run goes on as if no Ctrl-C had come (issue 48: a run stuck in an in-process scorer outlived its SIGINT by minutes).

``interrupt_guard`` closes both holes: a watchdog thread learns of every SIGINT/SIGTERM from the C-level handler
(``signal.set_wakeup_fd``, written whichever thread the kernel chose) and, until the guarded block ends, re-delivers
the signal to the main thread (``pthread_kill``) every ``RESEND_S`` seconds. The Python handler raises
``KeyboardInterrupt`` unless one is already unwinding the stack, so a re-delivery never cuts a cleanup short.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

RESEND_S = 2.0  # the first delivery normally works; a re-delivery is for the lost ones only


def _unwinding() -> bool:
    """Whether a KeyboardInterrupt (or an exception raised while handling one) is being handled in this thread."""
    e = sys.exc_info()[1]
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__context__
    return False


def raise_interrupt(signum, frame) -> None:
    """A signal handler: ``KeyboardInterrupt`` unless one is already unwinding this thread's stack, so a second signal
    (or the guard's re-delivery) never cuts the first one's cleanup short."""
    if not _unwinding():
        raise KeyboardInterrupt


_ACTIVE: list[dict] = []  # the handlers each guard open in this process replaced, innermost last


def _reset_in_child() -> None:
    """In a child forked under a guard (a reward worker, a vLLM worker): the parent's handlers and no wakeup fd. The
    fd is the parent's socket, so a signal to the child alone read as the parent's own and was re-delivered to it."""
    if not _ACTIVE:
        return
    with contextlib.suppress(ValueError):  # forked from another thread than the main one: signal calls refused
        signal.set_wakeup_fd(-1)
        for s, h in _ACTIVE[0].items():
            signal.signal(s, h)
    _ACTIVE.clear()


os.register_at_fork(after_in_child=_reset_in_child)


def _watch(reader: socket.socket, done: threading.Event, codes: set[int]) -> None:
    """Wait for the first of ``codes`` on the wakeup socket, then re-deliver it to the main thread until ``done``."""
    got = None
    while got is None and not done.is_set():
        try:
            data = reader.recv(64)
        except OSError:
            return
        got = next((c for c in data if c in codes), None)
    reader.settimeout(RESEND_S)
    main = threading.main_thread().ident
    while not done.wait(RESEND_S):
        signal.pthread_kill(main, got)
        with contextlib.suppress(OSError):
            reader.recv(64)  # drain the re-delivery's own byte


@contextlib.contextmanager
def interrupt_guard():
    """Within the block, SIGINT and SIGTERM raise ``KeyboardInterrupt`` in the main thread, re-delivered until one
    is being handled (module docstring).

    A no-op outside the main thread and where another wakeup fd is set (an asyncio loop's). A SIGINT whose
    disposition is "ignore" (a shell's background job: the user asked for it) or a handler of the caller's own is
    left alone; SIGTERM is always taken.
    A SIGINT blocked in the main thread's mask (inherited from a parent that blocked it around a fork) is unblocked.
    The previous handlers and wakeup fd are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIGTERM always (a scheduler's stop ends the run as Ctrl-C does); SIGINT only where Python's own handler is
    wanted = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is signal.default_int_handler else [])
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        reader.close(), writer.close()
        yield
        return
    if previous_fd != -1:  # someone else's wakeup fd (an event loop): leave signals to them
        signal.set_wakeup_fd(previous_fd)
        reader.close(), writer.close()
        yield
        return
    old = {s: signal.signal(s, raise_interrupt) for s in wanted}
    _ACTIVE.append(old)
    if signal.SIGINT in wanted:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    done = threading.Event()
    codes = {int(s) for s in wanted}
    watcher = threading.Thread(target=_watch, args=(reader, done, codes), daemon=True,
                               name="trustbatch-interrupt-watch")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(-1)  # before the writer's fd closes (and its number is reused)
        try:
            writer.close()  # wakes the watcher's recv
            # the handlers stay ours until the watcher has ended: a re-delivery it sent just as the block ended
            # meets raise_interrupt, not SIGTERM's default action (which killed the process without its message)
            watcher.join(timeout=RESEND_S + 1)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            # a child forked inside the block leaves it too, with _ACTIVE cleared at the fork (_reset_in_child)
            _ACTIVE[:] = [a for a in _ACTIVE if a is not old]
            reader.close()
