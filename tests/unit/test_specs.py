"""Specs in, parts out: the engine registry's refusals, the backend lookup's coverage, the specs built from Config."""

import typing

import pytest

from trustbatch.config import Config, RolloutConfig, load_config
from trustbatch.errors import UserError


@pytest.mark.parametrize("call", ["check_engine", "make_engine"])
def test_the_engine_registry_refuses_an_unknown_engine_in_one_line(call):
    from trustbatch.rollout import spec

    args = (spec.EngineSpec(name="sglang"),) + ((None,) if call == "make_engine" else ())
    with pytest.raises(UserError) as e:
        getattr(spec, call)(*args)
    message = str(e.value)
    assert "\n" not in message
    assert "'sglang'" in message and "transformers" in message and "vllm" in message  # the cause and the fix


def test_every_mode_and_orchestrator_the_config_accepts_has_a_backend():
    from trustbatch.recipes.backends import backend_for

    # the values come from the config's own Literal annotations, not from the registry
    modes = typing.get_args(RolloutConfig.model_fields["mode"].annotation)
    orchestrators = typing.get_args(Config.model_fields["orchestrator"].annotation)
    assert set(modes) == {"sync", "async"} and set(orchestrators) == {"local", "ray"}
    for mode in modes:
        for orchestrator in orchestrators:
            backend = backend_for(load_config(None, [f"rollout.mode={mode}", f"orchestrator={orchestrator}"]))
            assert callable(backend.check) and callable(backend.learner) and callable(backend.source)
    with pytest.raises(UserError, match="add rollout.mode=async"):  # Ray runs rollout workers; sync has none
        backend_for(load_config(None, ["orchestrator=ray"])).check(load_config(None, ["orchestrator=ray"]))


def test_the_specs_carry_every_configured_value():
    from trustbatch.recipes.build import engine_spec, reward_spec, source_spec

    cfg = load_config(None, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.max_new_tokens=12",
                             "rollout.group_size=3", "rollout.prompts_per_step=5", "train.seed=11",
                             "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2", "rollout.overlong_cache=4",
                             "objective.std=sample", "rollout.prompt_order=random", "rollout.precision=bfloat16",
                             "threads=3", "reward.workers=0", "reward.timeout_s=2.5", "reward.max_failure_rate=0.25"])
    s = source_spec(cfg)
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.max_new_tokens, s.sampling.greedy) == (0.7, 0.9, 12, False)
    assert (s.group_size, s.prompts_per_step, s.seed, s.dynamic_sampling, s.max_sampling_rounds, s.overlong_cache,
            s.std, s.prompt_order) == (3, 5, 11, True, 2, 4, "sample", "random")
    assert source_spec(load_config(None, ["objective.advantage=rloo"])).advantage == "rloo"
    e = engine_spec(cfg)
    assert (e.name, e.precision, e.quantization, e.seed, e.threads) == ("transformers", "bfloat16", None, 11, 3)
    assert not s.behaviour_models
    assert source_spec(load_config(None, ["objective.options={kl: exact}"])).behaviour_models  # P3O's exact KL

    class Task:
        reward = "rg:chain_sum"

    r = reward_spec(cfg, Task())
    assert (r.name, r.workers, r.timeout_s, r.max_failure_rate) == ("rg:chain_sum", 0, 2.5, 0.25)

    class MathData:
        reward = "math"

    assert reward_spec(load_config(None, ["reward.name=gsm8k"]), MathData()).name == "gsm8k"
    weighted = load_config(None, ["reward.functions=[{name: gsm8k, weight: 0.5}, {name: math}]"])
    assert reward_spec(weighted, MathData()).name == (("gsm8k", 0.5), ("math", 1.0))  # training sums the terms
    assert reward_spec(weighted, MathData(), heldout=True).name == "math"  # held-out keeps the data's scorer
    # a plain-answer scorer on a task whose references are JSON scored the JSON's last number
    for bad in (["reward.name=gsm8k"], ["reward.functions=[{name: math}, {name: m:f}]"]):
        with pytest.raises(UserError, match="reads a plain answer, but this data's answers are JSON, scored by "
                                            "'rg:chain_sum'"):
            reward_spec(load_config(None, bad), Task())
