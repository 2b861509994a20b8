"""Loading a real HF model from a local directory, and the behaviour log-prob contract of the engine."""

import pytest
import torch

from trustbatch.errors import UserError
from trustbatch.policy import load_policy
from trustbatch.policy.forward import pack, response_logprobs
from trustbatch.rollout import SamplingParams, TransformersEngine


@pytest.fixture(scope="module")
def stories(shared_dir):
    return load_policy(shared_dir / "models" / "stories260K-hf")


def test_stories260k_loads_and_generates(stories):
    ids = stories.encode_prompt("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]  # the ids in shared/models/README.md
    eng = TransformersEngine(stories.model, stories.eos_id, stories.pad_id)
    ro = eng.generate([ids], 1, SamplingParams(max_new_tokens=30, greedy=True))
    # the first greedy tokens documented in shared/models/README.md
    assert ro[0].completion_ids[:10] == [432, 383, 286, 261, 376, 298, 315, 421, 395, 317]


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.2])
def test_behaviour_logprobs_are_log_softmax_of_logits_over_t(stories, temperature):
    torch.manual_seed(0)
    eng = TransformersEngine(stories.model, stories.eos_id, stories.pad_id)
    prompts = [stories.encode_prompt("Once upon a time"), stories.encode_prompt("Lily saw a big dog")]
    ro = eng.generate(prompts, 3, SamplingParams(temperature=temperature, max_new_tokens=12))
    assert [r.prompt_index for r in ro] == [0, 0, 0, 1, 1, 1]
    packed = pack([r.prompt_ids for r in ro], [r.completion_ids for r in ro], stories.pad_id)
    with torch.no_grad():
        lp, _ = response_logprobs(stories.model, packed, temperature=temperature)
    C = packed.response_mask.shape[1]
    for i, r in enumerate(ro):
        got = torch.tensor(r.behavior_logprobs)
        want = lp[i, C - len(r.completion_ids):]
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    if temperature != 1.0:  # and they are not the T = 1 log-probs
        with torch.no_grad():
            lp1, _ = response_logprobs(stories.model, packed)
        assert (lp1 - lp)[packed.response_mask].abs().max() > 1e-3


def test_missing_model_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_policy(tmp_path / "nope")
    with pytest.raises(UserError, match="no config.json"):
        load_policy(tmp_path)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_every_end_token_the_model_names_ends_a_completion(shared_dir, tmp_path, decode):
    """An Instruct model names its end of turn beside the tokenizer's EOS (Qwen2.5-Instruct's generation_config:
    eos_token_id [<|im_end|>, <|endoftext|>]). Here stories260K's generation_config names its greedy third token too:
    the completion ends there (it ran on to the budget, past the end of the turn, before)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(shared_dir / "models" / "stories260K-hf", model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 286]}))
    policy = load_policy(model)
    assert policy.eos_id == 2 and policy.end_ids == (2, 286)
    prompt = policy.encode_prompt("Once upon a time")
    sp = SamplingParams(max_new_tokens=30, greedy=True)
    ro = TransformersEngine(policy.model, policy.end_ids, policy.pad_id, decode=decode).generate([prompt], 1, sp)[0]
    assert ro.completion_ids == [432, 383, 286] and not ro.truncated  # shared/models/README.md's greedy tokens
    plain = TransformersEngine(policy.model, policy.eos_id, policy.pad_id, decode=decode).generate([prompt], 1, sp)[0]
    assert plain.completion_ids[:10] == [432, 383, 286, 261, 376, 298, 315, 421, 395, 317]
    from trustbatch.config import load_config
    from trustbatch.recipes.export import _generation_config

    assert _generation_config(policy, load_config()).eos_token_id == [2, 286]  # an export keeps both (it kept 2)
