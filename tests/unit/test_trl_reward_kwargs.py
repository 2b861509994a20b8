"""TRL's ``trainer_state``, ``log_metric`` and ``log_extra`` for batch-form rewards (``rewards.trl_kwargs``):
which functions get them, what a bad call says, and how what they log is laid out over several calls and
functions. Reference: the values worked by hand."""

import numpy as np
import pytest
import torch

from trustbatch.rewards import GROUP_KEY, STATE_KEY, TrainerState, WeightedRewards, round_state, score_local
from trustbatch.rewards.scorers import BatchForm
from trustbatch.rewards.trl_kwargs import RewardLogs


def _ctx(groups, state=None):
    return [{"prompt": f"p{g}", GROUP_KEY: g, **({} if state is None else {STATE_KEY: state})}
            for g, n in enumerate(groups) for _ in range(n)]


def test_only_a_function_that_takes_them_gets_them():
    got = {}

    def named(prompts, completions, reference, trainer_state, log_metric):
        got["named"] = (trainer_state, log_metric.__name__)
        return [0.0] * len(completions)

    def plain(prompts, completions, reference):  # no **kwargs: it gets none of them
        return [1.0] * len(completions)

    def any_kwargs(completions, **kwargs):
        got["kwargs"] = sorted(kwargs)
        return [0.5] * len(completions)

    state = round_state(6, 20, 3, 4, 48)
    for fn, want in ((named, 0.0), (plain, 1.0), (any_kwargs, 0.5)):
        res = score_local(BatchForm(fn), ["a", "b"], ["", ""], contexts=_ctx([2], state))
        assert res.rewards == [want, want] and res.errors == 0, res.last_error
    assert got["named"] == (TrainerState(global_step=6, max_steps=20, epoch=0.25), "log_metric")
    assert got["kwargs"] == ["log_extra", "log_metric", "prompts", "reference", "trainer_state"]


def test_a_data_column_of_the_same_name_gives_way_as_in_trl():
    seen = []

    def f(completions, trainer_state, **kwargs):
        seen.append(trainer_state)
        return [0.0] * len(completions)

    ctx = [{**c, "trainer_state": "a column"} for c in _ctx([1], round_state(1, 2, 0, 1, 1))]
    score_local(BatchForm(f), ["a"], [""], contexts=ctx)
    assert seen == [TrainerState(1, 2, 0.0)]


@pytest.mark.parametrize("call, says", [
    (lambda logs: logs.log_metric("m", "high"), "log_metric('m', value) got str 'high'; give a number"),
    (lambda logs: logs.log_metric("m", float("nan")), "log_metric('m', value) got nan; give a finite number"),
    (lambda logs: logs.log_metric("", 1.0), "got name ''; give a non-empty string"),
    (lambda logs: logs.log_extra("c", [1]), "log_extra('c', values) got 1 values for 2 completions"),
])
def test_a_bad_log_call_fails_the_call_with_its_cause(call, says):
    def f(completions, log_metric, log_extra, **kwargs):
        call(type("Logs", (), {"log_metric": staticmethod(log_metric),
                               "log_extra": staticmethod(log_extra)}))
        return [1.0] * len(completions)

    res = score_local(BatchForm(f), ["a", "b"], ["", ""], contexts=_ctx([2]))
    assert res.rewards == [0.0, 0.0] and res.errors == 2 and says in res.last_error
    assert res.logged == {} and res.extra == {}  # a failed call logs nothing


def test_cells_are_what_json_holds():
    logs = RewardLogs(7)
    logs.log_extra("c", [1, 0.5, "x", None, np.float32(0.25), torch.tensor(3), float("inf")])
    logs.log_extra("d", [[1, 2], {"k": 1}, object, torch.ones(2), True, np.int64(4), "y"])
    c, d = logs.result()[1]["c"], logs.result()[1]["d"]
    assert c == [1, 0.5, "x", None, 0.25, 3, "inf"]
    assert d[:2] == [[1, 2], {"k": 1}] and d[2] == str(object) and d[3] == str(torch.ones(2)) and d[4:] == [True, 4, "y"]


def _logging(completions, log_metric, log_extra, **kwargs):
    log_metric("n", float(len(completions)))
    log_extra("len", [len(c) for c in completions])
    return [0.0] * len(completions)


def _logging_too(completions, log_metric, log_extra, **kwargs):
    log_metric("n", 10.0)
    log_extra("first", [c[0] for c in completions])
    log_extra("len", [-1] * len(completions))
    return [0.0] * len(completions)


def test_what_calls_and_functions_log_is_laid_out_by_completion(monkeypatch):
    texts = ["aa", "b", "cccc", "dd", "e"]
    res = score_local(BatchForm(_logging), texts, [""] * 5, contexts=_ctx([2, 3]))
    assert res.logged == {"n": [2.0, 3.0]} and res.extra == {"len": {0: 2, 1: 1, 2: 4, 3: 2, 4: 1}}
    both = res + score_local(BatchForm(_logging), ["x"], [""], contexts=_ctx([1]))  # a second call: indices move
    assert both.logged == {"n": [2.0, 3.0, 1.0]} and both.extra["len"][5] == 1
    # two functions: each one's metric values, in order; a later function's column wins
    from trustbatch.rewards import functions

    monkeypatch.setitem(functions.__dict__, "RewardPool", _LocalPool)
    w = WeightedRewards([("a", 1.0), ("b", 1.0)], workers=0)
    res = w.score(texts, [""] * 5, contexts=_ctx([2, 3]))
    assert res.logged == {"n": [2.0, 3.0, 10.0, 10.0]}
    assert res.extra == {"len": {i: -1 for i in range(5)}, "first": {i: t[0] for i, t in enumerate(texts)}}


class _LocalPool:
    """A reward pool scoring one of the two functions above in this process."""

    def __init__(self, name, **kwargs):
        self.form = BatchForm(_logging if name == "a" else _logging_too)

    def score(self, completions, references, *, contexts=None, max_failure_rate=None):
        return score_local(self.form, completions, references, contexts=contexts)

    def close(self):
        pass


def test_a_column_named_as_a_samples_own_key_is_left_out(tmp_path):
    """A log_extra column "round" overwrote the line's round in samples.jsonl: every line said round 1, and a resume,
    which cuts the file back by round, kept the rounds it redid (a reviewer's run: 52 lines where 40)."""
    from trustbatch.eval.sampling import sample_row, with_extras
    from trustbatch.trainer.runlog import MetricsLog

    rows = [sample_row("p", "c", 1.0, "r", -2.0), sample_row("q", "d", 0.0, "s", -1.0)]
    extras = [{"round": 1, "split": "x", "step": 9, "reward": 5, "mine": "a"}, {"other": 2}]
    got = with_extras(rows, extras)
    assert got == [{**rows[0], "mine": "a", "other": None}, {**rows[1], "mine": None, "other": 2}]
    log = MetricsLog(tmp_path)
    log.log_samples(3, "train", [{**got[0], "round": 1, "split": "x"}])  # a caller that let one through
    import json

    line = json.loads((tmp_path / "samples.jsonl").read_text())
    assert (line["round"], line["split"]) == (3, "train")


def test_columns_and_return_types_as_trl_takes_them():
    """TRL passes every data column but prompt and completion (a column named reference as it is) and reads the
    return with torch.tensor(...): a NumPy array, a tensor and a list of 0-d tensors were refused here, with a
    message that blamed the length; a data column named reference was replaced by the gold answers."""
    seen = {}
    returns = iter([np.array([0.5, 1.5]), torch.tensor([0.25, -1.0]), [torch.tensor(2.0), np.float32(0.75)],
                    np.array([[1.0], [0.0]]), [1.0]])

    def f(prompts, completions, reference, **kwargs):
        seen.update(reference=reference, keys=sorted(kwargs))
        return next(returns)

    ctx = [{"prompt": "p", "completion": "a gold completion", "reference": "a human summary", "id": 7,
            GROUP_KEY: 0} for _ in range(2)]
    got = [score_local(BatchForm(f), ["a", "b"], ["5", "5"], contexts=ctx, clamp=False) for _ in range(5)]
    assert seen["reference"] == ["a human summary"] * 2 and "completion" not in seen["keys"] and "id" in seen["keys"]
    assert [r.rewards for r in got[:3]] == [[0.5, 1.5], [0.25, -1.0], [2.0, 0.75]]
    assert "return a list (or a 1-D array or tensor) of one score per completion" in got[3].last_error
    assert "returned 1 scores for 2 completions" in got[4].last_error


def test_nan_from_a_batch_form_function_does_not_apply_as_in_trl():
    """TRL turns None into NaN and sums with nansum, so a function's NaN is its "does not apply" (a NumPy array can
    hold no None); it was counted here as the function's error (reward 0, toward the failure limit)."""
    def f(completions, **kwargs):
        return np.array([1.0, np.nan, 0.5])

    res = score_local(BatchForm(f), ["a", "b", "c"], [""] * 3, contexts=_ctx([3]), clamp=False)
    assert res.rewards == [1.0, 0.0, 0.5] and res.errors == 0 and res.none == [1]
    inf = score_local(BatchForm(lambda completions, **kw: [float("inf")] * 3), ["a", "b", "c"], [""] * 3,
                      contexts=_ctx([3]))
    assert inf.errors == 3  # an infinite score is still an error
