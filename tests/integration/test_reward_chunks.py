"""The reward pool sends completions in chunks and keeps the per-completion rules.

Expected rewards and counts are worked out from the scorer's definition, item by item; a failure in
the middle of a chunk must cost that completion alone, and the time limit must stay per completion.
"""

import json
import textwrap

import pytest

from trustbatch.rewards import GROUP_KEY, RewardPool
from trustbatch.rewards import pool as pool_mod

ITEMS = ["ok", "a", "hang", "ok", "die", "ok", "raise", "nan", "ok", "no", "ok", "ok", "die", "ok"]


def expected(items):
    """misbehave: 1 when the completion equals the reference "ok"; hang, die, raise and nan give 0."""
    return [1.0 if c == "ok" else 0.0 for c in items]


@pytest.mark.parametrize("workers,chunk", [(1, 6), (2, 4), (2, 32)])
def test_failures_inside_a_chunk_cost_one_completion_each(workers, chunk):
    with RewardPool("scorers_for_tests:misbehave", workers=workers, timeout_s=0.5, chunk_size=chunk) as pool:
        res = pool.score(ITEMS, ["ok"] * len(ITEMS))
        assert res.rewards == expected(ITEMS)
        assert res.timeouts == ITEMS.count("hang")
        assert res.errors == sum(ITEMS.count(x) for x in ("die", "raise", "nan"))
        again = pool.score(["ok", "no"] * 5, ["ok"] * 10)  # the replacement workers score
        assert again.rewards == [1.0, 0.0] * 5 and again.errors == again.timeouts == 0


def test_the_time_limit_is_per_completion_not_per_chunk(tmp_path, monkeypatch):
    (tmp_path / "slow_scorer.py").write_text(textwrap.dedent('''
        import time
        def score(completion, reference):
            time.sleep(0.3)
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    # a chunk of 4 takes 1.2 s, each completion 0.3 s, the limit 0.8 s
    with RewardPool("slow_scorer:score", workers=1, timeout_s=0.8, chunk_size=4) as pool:
        res = pool.score(["x"] * 4, [""] * 4)
    assert res.rewards == [1.0] * 4 and res.timeouts == 0 and res.errors == 0


def test_a_scorers_warm_up_is_not_charged_to_a_completion(tmp_path, monkeypatch):
    """A scorer's ``warm_up`` (math's: importing math-verify and sympy) runs once per worker before its first
    completion, and the time limit starts after it: here 1.2 s of warm-up against a 0.5 s limit, for a chunk sent
    at once and for the worker that replaces one killed by a hang (before, the first completion timed out)."""
    (tmp_path / "slow_start.py").write_text(textwrap.dedent('''
        import time
        loaded = []
        def load():  # what math does on first use: import math-verify
            time.sleep(1.2)
            loaded.append(True)
        def score(completion, reference):
            if not loaded:
                load()
            if completion == "hang":
                time.sleep(30)
            return 1.0
        score.warm_up = load
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardPool("slow_start:score", workers=1, timeout_s=0.5, chunk_size=2) as pool:
        res = pool.score(["x", "hang", "x", "x"], [""] * 4)
    assert res.rewards == [1.0, 0.0, 1.0, 1.0] and res.timeouts == 1 and res.errors == 0


def test_the_math_scorer_warms_up_math_verify():
    import subprocess
    import sys

    code = ("import sys; from trustbatch.rewards import get; get('math').warm_up(); "
            "print('math_verify' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def test_one_message_per_chunk(monkeypatch):
    sent = []
    real = pool_mod._Worker.send
    monkeypatch.setattr(pool_mod._Worker, "send", lambda self, job, *rest: (sent.append(list(job)), real(self, job, *rest)))
    comps = [str(i) for i in range(10)]
    with RewardPool("scorers_for_tests:misbehave", workers=1, chunk_size=4) as pool:
        res = pool.score(comps, [str(i) if i % 3 else "x" for i in range(10)])
    assert res.rewards == [0.0 if i % 3 == 0 else 1.0 for i in range(10)]
    assert sent == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        RewardPool("scorers_for_tests:misbehave", chunk_size=0)


def _group_contexts(sizes):
    """Contexts of consecutive groups of these sizes, numbered as the rollout source numbers them; every group has
    the same prompt, so only the group numbers tell them apart."""
    return [{"prompt": "p", GROUP_KEY: g} for g, k in enumerate(sizes) for _ in range(k)]


def _by_hand(group):
    """longer_than_others, worked out again: the share of the group's other completions each is longer than."""
    return [sum(len(o) < len(c) for o in group) / max(1, len(group) - 1) for c in group]


@pytest.mark.parametrize("workers,chunk", [(0, 32), (1, 32), (2, 4), (2, 1)])
def test_a_named_batch_form_function_is_called_once_per_group_in_the_workers(tmp_path, monkeypatch, workers, chunk):
    """Before, a named batch-form function was called one completion at a time: every reward was 0/0 → 0."""
    monkeypatch.setenv("SCORER_CALLS", str(tmp_path / "calls.jsonl"))
    sizes = [3, 1, 4, 2]
    comps = ["a", "bbb", "cc", "z", "dddd", "e", "ff", "ggg", "hh", "h"]
    with RewardPool("scorers_for_tests:longer_than_others", workers=workers, chunk_size=chunk) as pool:
        res = pool.score(comps, [""] * len(comps), contexts=_group_contexts(sizes))
    groups, start = [], 0
    for k in sizes:
        groups.append(comps[start:start + k])
        start += k
    assert res.rewards == [v for g in groups for v in _by_hand(g)]
    assert res.errors == res.timeouts == 0
    calls = [json.loads(line)[1] for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert sorted(calls) == sorted(groups)  # one call per group, whichever worker made it


def test_a_groups_time_limit_is_its_size_times_timeout_and_a_hung_group_fails_whole(tmp_path):
    """A group of 4 taking 2 s is within 4 × 1 s; the group that hangs is timed out, each of its completions
    counted, and the groups after it are scored by a fresh worker."""
    comps = ["slow", "slow", "slow", "slowest", "x", "hang", "yy", "ok", "okk"]
    with RewardPool("scorers_for_tests:longer_than_others", workers=1, timeout_s=1.0) as pool:
        res = pool.score(comps, [""] * len(comps), contexts=_group_contexts([4, 3, 2]))
    assert res.rewards == _by_hand(comps[:4]) + [0.0] * 3 + _by_hand(comps[7:])
    assert (res.timeouts, res.errors) == (3, 0)
    assert "reward.timeout_s=1 s" in res.last_error
