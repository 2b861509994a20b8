"""Issue 45 item 2 through a real run: ``data.max_prompt_tokens`` truncates or skips the long prompts, and each round's
``prompts_truncated`` / ``prompts_skipped`` are what the prompts the reward saw say, counted here with the tokenizer."""

import pytest
from transformers import AutoTokenizer

from trustbatch.api import Trainer

from runproc import records

LIMIT = 40
# odd rows carry a first sentence: 49 tokens with stories260K's tokenizer (BOS included), even rows 36
ROWS = [{"question": "Once upon a time there was a girl named Lily. " * (i % 2)
         + f"Lily has {i} apples and finds {i % 7 + 1} more. How many apples does she have?",
         "answer": i + i % 7 + 1} for i in range(40)]
P = 4
RUN = ["reward.workers=0", f"rollout.prompts_per_step={P}", "rollout.group_size=2", "rollout.max_new_tokens=4",
       "train.steps=2", "eval.every=2", "eval.samples_per_prompt=1", "checkpoint_every=2", "threads=1",
       f"data.max_prompt_tokens={LIMIT}", "data.prompt_field=question", "data.answer_field=answer"]  # prompts as written


def _run(tmp_path, shared_dir, mode: str):
    model = shared_dir / "models" / "stories260K-hf"
    groups: list[list[str]] = []

    def prompts_seen(prompts, completions, reference, **columns):  # one group (prompt) per call
        groups.append(list(prompts))
        return [0.5] * len(completions)

    run = tmp_path / mode
    Trainer(model=model, reward_funcs=[prompts_seen], train_dataset=ROWS[8:], eval_dataset=ROWS[:8],
            overrides=RUN + [f"data.long_prompts={mode}", f"run_dir={run}"]).train()
    tok = AutoTokenizer.from_pretrained(model)
    long = {r["question"] for r in ROWS if len(tok(r["question"])["input_ids"]) > LIMIT}
    assert len(long) == 20  # the odd rows
    rounds = [r for r in records(run) if r["step"] > 0]
    assert len(rounds) == 2 and len(groups) == 2 * P
    return long, rounds, [[g[0] for g in groups[k * P:(k + 1) * P]] for k in range(2)]


def test_truncate_counts_each_rounds_long_prompts(tmp_path, shared_dir):
    long, rounds, drawn = _run(tmp_path, shared_dir, "truncate")
    for rec, prompts in zip(rounds, drawn):
        assert rec["prompts_truncated"] == sum(p in long for p in prompts)
        assert rec["prompts_skipped"] == 0
    assert sum(r["prompts_truncated"] for r in rounds) > 0  # the check saw some


def test_skip_drops_the_long_prompts_and_counts_them(tmp_path, shared_dir):
    long, rounds, drawn = _run(tmp_path, shared_dir, "skip")
    trainable = [r["question"] for r in ROWS[8:]]
    for rec, prompts in zip(rounds, drawn):
        assert not any(p in long for p in prompts)
        assert rec["prompts_skipped"] == sum(p in long for p in trainable) == 16
        assert rec["prompts_truncated"] == 0
