"""``eval.reward``: what scores held-out evaluation. ``data`` (the default) keeps the data's own scorer (plain
answers: math), ``functions`` the training reward's functions, as TRL scores its eval dataset: the way to text
answers, which math cannot read. Reference: the function's values worked from the completions it saw."""

import json

import pytest

from trustbatch.api import Trainer
from trustbatch.config import load_config

from runproc import main_in_process, records

CITIES = ["Paris", "Rome", "Madrid", "Berlin", "Lisbon", "Vienna", "Prague", "Warsaw"]
ROWS = [{"prompt": f"Tell me a story about {CITIES[i % 8]} {i}. The city is", "answer": CITIES[i % 8]}
        for i in range(40)]
RUN = ["reward.workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
       "train.steps=1", "eval.every=1", "eval.samples_per_prompt=2", "data.heldout_size=8", "threads=1"]


def _share(completion: str, answer: str) -> float:  # the text's letters found in the completion
    return sum(ch in completion for ch in answer) / len(answer)


@pytest.mark.parametrize("scorer", ["data", "functions"])
def test_text_answers_are_scored_by_the_functions_with_eval_reward_functions(tmp_path, shared_dir, scorer):
    seen: list[tuple[list[str], list[str]]] = []

    def letters(completions, answer, **kwargs):
        seen.append((list(completions), list(answer)))
        return [_share(c, a) for c, a in zip(completions, answer)]

    run = tmp_path / "run"
    Trainer(model=shared_dir / "models" / "stories260K-hf", reward_funcs=[letters], train_dataset=ROWS[8:],
            eval_dataset=ROWS[:8], overrides=RUN + [f"run_dir={run}", f"eval.reward={scorer}"]).train()
    recs = records(run)
    if scorer == "data":  # math (math-verify) on the held-out answers, the function in training alone
        assert [len(c) for c, _ in seen] == [4] * 4
        assert recs[0]["heldout_accuracy"] == 0.0  # what math makes of text answers
        return
    # held-out at rounds 0 and 1 (8 prompts: 2 samples each, then greedy), around one round of 4 groups of 4
    assert [len(c) for c, _ in seen] == [2] * 8 + [1] * 8 + [4] * 4 + [2] * 8 + [1] * 8
    for rec, calls in ((recs[0], seen[:8]), (recs[1], seen[20:28])):
        values = [_share(c, a) for cs, ans in calls for c, a in zip(cs, ans)]
        assert rec["heldout_accuracy"] == pytest.approx(sum(values) / len(values), abs=1e-12)
    from trustbatch.recipes.export import eval_command  # trustbatch eval takes one scorer, not the functions

    assert eval_command(load_config(run / "config.yaml"), tmp_path / "export", 1) is None


def test_eval_reward_functions_needs_a_function(tmp_path, shared_dir, monkeypatch, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    code, _, err = main_in_process(monkeypatch, capsys, "train", f"data={data}", *RUN, "eval.reward=functions",
                                   f"model.path={shared_dir / 'models' / 'stories260K-hf'}",
                                   f"run_dir={tmp_path / 'run'}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "eval.reward=functions" in lines[0] and "reward.functions" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_reward_model_term_is_left_to_training(tmp_path):
    from trustbatch.recipes.build import configured_task, reward_spec

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(None, [f"data={data}", "data.heldout_size=8", "eval.reward=functions", "reward.functions=["
                             "{name: rm:/some/reward-model, weight: 0.5}, {name: scorers_for_tests:digit_fraction}]"])
    task = configured_task(cfg)
    assert reward_spec(cfg, task).name == (("rm:/some/reward-model", 0.5), ("scorers_for_tests:digit_fraction", 1.0))
    assert reward_spec(cfg, task, heldout=True).name == (("scorers_for_tests:digit_fraction", 1.0),)
    default = load_config(None, [f"data={data}", "data.heldout_size=8"])
    assert reward_spec(default, configured_task(default), heldout=True).name == "math"
