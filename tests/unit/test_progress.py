"""Issue 37 (item 7): every progress display has an ETA, and off a terminal its lines are plain and never wrapped.

ETAs are checked against hand-worked values on a fake clock (2 s per step).
"""

import io

import pytest
from rich.console import Console

from trustbatch.trainer import progress as progress_mod
from trustbatch.trainer.progress import PlainProgress, Progress, progress_display


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress_mod.time, "time", lambda: now[0])
    return now


def _plain(width: int = 40) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=width), buf


def test_round_lines_carry_elapsed_and_eta_and_are_not_wrapped(clock):
    console, buf = _plain(width=40)
    info = "reward 0.500  ess 0.9999  " + "x" * 60  # longer than the console is wide
    with Progress(console, total=40) as bar:
        for r in range(1, 41):
            clock[0] += 2.0
            bar.advance(r, info)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 20  # every 2 rounds (40 // 20), one line each, none wrapped
    # round 20 of 40 after 40 s: 2 s a round, 20 left -> 40 s
    assert lines[9] == f"round 20/40  {info}  (elapsed 0:40, ETA 0:40)"
    assert lines[-1] == f"round 40/40  {info}  (elapsed 1:20, ETA 0:00)"


def test_a_resumed_loop_times_only_its_own_steps(clock):
    console, buf = _plain()
    with Progress(console, total=40, start=30) as bar:
        for r in range(31, 36):
            clock[0] += 2.0
            bar.advance(r, "")
    # round 34: 4 rounds in 8 s since the resume, 6 left -> 12 s (rounds 1-34 timed in 8 s would say 0:01)
    assert buf.getvalue().splitlines()[-1] == "round 34/40  (elapsed 0:08, ETA 0:12)"


def test_time_before_the_loop_starts_is_not_counted(clock):
    console, buf = _plain()
    bar = Progress(console, total=10, lines=10)
    clock[0] += 500.0  # the base's evaluation, between creating the display and entering the loop
    with bar:
        clock[0] += 3.0
        bar.advance(1, "")
    assert buf.getvalue().splitlines() == ["round 1/10  (elapsed 0:03, ETA 0:27)"]


def test_task_displays_print_a_line_per_share_and_at_the_end(clock):
    console, buf = _plain()
    with PlainProgress(console, lines=4) as p:
        t = p.add_task("gsm8k", total=100)
        for done in (10, 30, 60, 100):  # chunks of prompts, as trustbatch eval reports them
            clock[0] += 10.0
            p.update(t, completed=done)
    # every 25 prompts: a line when a chunk passes 25, 50, 75 and at 100
    assert buf.getvalue().splitlines() == ["gsm8k 30/100  (elapsed 0:20, ETA 0:47)",
                                           "gsm8k 60/100  (elapsed 0:30, ETA 0:20)",
                                           "gsm8k 100/100  (elapsed 0:40, ETA 0:00)"]


def test_a_terminal_gets_a_rich_bar_with_a_time_remaining_column():
    from rich.progress import Progress as RichProgress, TimeRemainingColumn

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    bar = progress_display(console, "RL")
    assert isinstance(bar, RichProgress)
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)
    assert isinstance(progress_display(_plain()[0]), PlainProgress)
