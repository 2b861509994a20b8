"""Issue 45 item 2: ``data.max_prompt_tokens`` with ``data.long_prompts`` = skip or truncate, on hand-made token lists
and on the real stories260K tokenizer (truncation keeps a prompt's END, as TRL's ``max_prompt_length``)."""

import pytest

from trustbatch.config import load_config
from trustbatch.data.benchmarks import limit_prompts, truncate_left
from trustbatch.data.tasks import LongPrompts
from trustbatch.errors import UserError

PROMPTS = [[1, 2, 3], [1, 5, 6, 7, 8], [9], [1, 2, 3, 4]]  # lengths 3, 5, 1, 4


def test_truncate_keeps_the_last_tokens():
    keep, ids, cut = limit_prompts(PROMPTS, 3, "truncate")
    assert keep == [0, 1, 2, 3] and cut == [1, 3]
    assert ids == [[1, 2, 3], [6, 7, 8], [9], [2, 3, 4]]  # the leftmost tokens went
    assert truncate_left([4, 5], 2) == [4, 5] and truncate_left([4, 5], None) == [4, 5]


def test_skip_drops_the_long_ones_and_truncates_none():
    keep, ids, cut = limit_prompts(PROMPTS, 3, "skip")
    assert keep == [0, 2] and ids == [[1, 2, 3], [9]] and cut == []
    assert limit_prompts(PROMPTS, 5, "skip")[0] == [0, 1, 2, 3]  # a prompt of exactly the limit stays whole


def test_a_round_counts_its_truncated_prompts_with_repeats():
    m = LongPrompts(truncated=frozenset({1, 3}), skipped=2).metrics([0, 1, 1, 3, 2])
    assert m == {"prompts_truncated": 3.0, "prompts_skipped": 2.0}


def test_the_policy_encodes_a_prompt_as_its_last_max_prompt_tokens(shared_dir):
    from transformers import AutoTokenizer

    from trustbatch.policy import load_policy

    path = shared_dir / "models" / "stories260K-hf"
    text = "Once upon a time there was a girl named Lily. Lily has 3 apples. How many apples does she have?"
    whole = AutoTokenizer.from_pretrained(path)(text)["input_ids"]  # BOS first: the default framing's
    policy = load_policy(path)
    assert policy.encode_prompt(text) == whole and len(whole) > 10
    policy.max_prompt_tokens = 10
    assert policy.encode_prompt(text) == whole[-10:]
    assert policy.decode(policy.encode_prompt(text)).endswith("does she have?")  # the end is kept, BOS cut


def test_truncate_needs_a_limit():
    with pytest.raises(UserError, match="data.long_prompts=truncate needs data.max_prompt_tokens"):
        load_config(None, ["data.long_prompts=truncate"])
    with pytest.raises(UserError, match="data.max_prompt_tokens"):
        load_config(None, ["data.max_prompt_tokens=0"])
