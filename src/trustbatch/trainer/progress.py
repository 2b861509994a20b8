"""Progress displays: on a terminal a rich bar with elapsed time and ETA; otherwise (stdout to a file, a cluster
job's log) plain lines, a few per task, each with elapsed time and ETA and never wrapped.

``progress_display`` is what every display of the package uses (training rounds, the base's SFT, ``trustbatch eval``,
``trustbatch lab run``); ``Progress`` is the training loop's round display on top of it.
"""

from __future__ import annotations

import time


def _duration(s: float) -> str:
    """``s`` seconds as ``M:SS`` or ``H:MM:SS`` (rich's elapsed and remaining columns write the same)."""
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class PlainProgress:
    """The part of ``rich.progress.Progress`` the displays use (``add_task``, ``update``, ``advance``, a context
    manager), for a console that is not a terminal: a line each time a task passes another ``1/lines`` of its
    total (at most ``max_every`` units apart) and at its end, ``DESCRIPTION DONE/TOTAL  INFO  (elapsed E, ETA R)``.

    The ETA is the elapsed time per unit done in this process (from ``completed`` at ``add_task``, so a resumed
    run does not count its earlier rounds as instant) times the units left.
    """

    def __init__(self, console, lines: int = 20, max_every: int | None = None):
        self.console, self.lines, self.max_every = console, lines, max_every
        self._tasks: list[dict] = []

    def __enter__(self) -> "PlainProgress":
        for t in self._tasks:  # time spent between creating and entering (a base evaluation) is not the loop's
            t["t0"] = time.time()
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields) -> int:
        every = max(1, int(total or 1) // max(1, self.lines))
        if self.max_every is not None:
            every = min(every, self.max_every)
        self._tasks.append({"description": description, "total": total, "done": completed, "start": completed,
                            "t0": time.time(), "every": every, "fields": dict(fields)})
        return len(self._tasks) - 1

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: int, *, completed: float | None = None, advance: float | None = None, **fields) -> None:
        t = self._tasks[task_id]
        before = t["done"]
        t["done"] = completed if completed is not None else before + (advance or 0)
        t["fields"].update(fields)
        crossed = int(t["done"]) // t["every"] > int(before) // t["every"]
        if t["done"] != before and (crossed or t["done"] == t["total"]):
            self.console.print(self.line(task_id), highlight=False, soft_wrap=True, markup=False)

    def line(self, task_id: int) -> str:
        t = self._tasks[task_id]
        elapsed = time.time() - t["t0"]
        done, total = int(t["done"]), t["total"]
        rate = elapsed / (t["done"] - t["start"]) if t["done"] > t["start"] else None
        eta = _duration(rate * (total - t["done"])) if rate is not None and total is not None else "?"
        info = t["fields"].get("info", "")
        return (f"{t['description']} {done}/{int(total) if total is not None else '?'}  "
                f"{info + '  ' if info else ''}(elapsed {_duration(elapsed)}, ETA {eta})")


def progress_display(console, label: str = "", lines: int = 20, max_every: int | None = None):
    """A ``rich.progress.Progress`` (bar, done/total, elapsed, ETA, the task's ``info`` field) when ``console`` is a
    terminal, else a ``PlainProgress``. ``label`` heads the bar (default: each task's description)."""
    if not console.is_terminal:
        return PlainProgress(console, lines=lines, max_every=max_every)
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, ProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class InfoColumn(ProgressColumn):
        def render(self, task):  # a task added without an ``info`` field shows nothing
            return Text(str(task.fields.get("info", "")))

    return RichProgress(TextColumn(f"[bold]{label}" if label else "{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                        InfoColumn(), console=console, transient=False)


class Progress:
    """Progress of a loop of ``total`` steps (training rounds, SFT steps): ``advance(i, info)`` after step ``i``.

    A rich bar on a terminal; a plain line every few steps otherwise (about ``lines`` for the whole loop, never
    fewer than one every ``max_every`` steps), each with elapsed time and ETA. ``enabled=False`` (data-parallel
    ranks other than 0) shows nothing.
    """

    def __init__(self, console, *, total: int, start: int = 0, enabled: bool = True, label: str = "RL",
                 unit: str = "round", lines: int = 20, max_every: int | None = 10):
        self.enabled = enabled
        self._display = progress_display(console, label, lines=lines, max_every=max_every) if enabled else None
        if self._display is not None:
            self._task = self._display.add_task(unit, total=total, completed=start, info="")

    def __enter__(self) -> "Progress":
        if self._display is not None:
            self._display.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._display is not None:
            self._display.__exit__(*exc)

    def advance(self, step: int, info: str) -> None:
        if self._display is not None:
            self._display.update(self._task, completed=step, info=info)
