"""Reward callables as TRL's GRPOTrainer runs them: ``async def`` functions on one event loop, and the names a run
saved for its Python-object rewards read back on resume."""

import functools

import pytest


def test_async_rewards_run_on_one_loop_also_under_a_callers_running_loop():
    """A reward's loop-bound state (a semaphore made at its first call) broke from the second group on (a loop per
    call), and under a caller's running loop (a notebook) every call failed (``asyncio.run`` refuses); TRL runs them
    on one loop of its own. Reference: the values by hand."""
    import asyncio

    from trustbatch.rewards.scorers import BatchForm

    state = {}

    async def judge(completions, **kwargs):
        state.setdefault("gate", asyncio.Semaphore(1))
        async with state["gate"]:
            return [float(len(c)) for c in completions]

    form = BatchForm(judge)
    for group in (["a", "bb"], ["ccc"]):
        assert form.score_group(group, [""] * len(group), None)[0] == [(float(len(c)), "outside" if len(c) > 1 else
                                                                      "ok", None) for c in group]

    async def notebook():  # a synchronous call of the trainer from inside a running loop
        return form.score_group(["dddd"], [""], None)[0]

    assert asyncio.run(notebook()) == [(4.0, "outside", None)]


def _length_target(completions, target, **kwargs):
    return [-abs(target - len(c)) for c in completions]


class _Punish:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


def test_a_run_saved_under_the_old_names_of_a_partial_and_an_instance_resumes():
    """Runs saved before partials and instances took TRL's names hold ``python:partial`` and the class's qualname: a
    resume with the same callables was refused, saying they differ. Reference: the objects registered under the
    saved names are the ones given."""
    from trustbatch.errors import UserError
    from trustbatch.rewards.objects import lookup, register_again

    given = [functools.partial(_length_target, target=5), functools.partial(_length_target, target=9), _Punish()]
    saved = ["python:partial", "python:partial#1", "python:_Punish"]
    register_again(given, saved)
    assert [lookup(n).fn for n in saved] == given
    register_again(given, ["python:_length_target", "python:_length_target#1", "python:_Punish"])  # today's names
    with pytest.raises(UserError, match="is given 'python:_length_target'"):
        register_again(given, ["python:other", "python:partial#1", "python:_Punish"])


def test_a_reward_model_given_as_a_reward_function_names_reward_model(tmp_path):
    """TRL takes a reward model's id or folder in reward_funcs; here it met "unknown reward" with no word of
    reward.model."""
    from trustbatch.api import Trainer
    from trustbatch.errors import UserError

    for given in ("org/some-reward-model", str(tmp_path)):
        with pytest.raises(UserError, match=f"a reward model .TRL's reward_funcs=.MODEL.. is reward.model={given} here"):
            Trainer(reward_funcs=[given], overrides={"run_dir": str(tmp_path / "run")}).train()
