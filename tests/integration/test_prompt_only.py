"""TRL's prompt-only rows (``{"prompt": ...}``, no answer: its quickstart trains trl-lib/tldr with a length reward):
``data.format=prompts``, scored by reward functions alone, held-out evaluation included. Reference: the functions'
values worked from the completions they saw."""

import json

import pytest

from trustbatch.api import Trainer
from trustbatch.config import load_config
from trustbatch.errors import UserError

from runproc import main_in_process, records

ROWS = [{"prompt": f"Once upon a time, a cat named Tom {i} "} for i in range(40)]
RUN = ["reward.workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
       "train.steps=2", "eval.every=2", "eval.samples_per_prompt=2", "data.heldout_size=8", "threads=1"]


def test_trls_quickstart_trains_on_prompts_alone_with_a_length_reward(tmp_path, shared_dir):
    seen: list[list[str]] = []

    def reward_len(completions, **kwargs):  # TRL's quickstart reward, negative as there
        seen.append(list(completions))
        return [-abs(20 - len(c)) for c in completions]

    run = tmp_path / "run"
    Trainer(model=shared_dir / "models" / "stories260K-hf", reward_funcs=[reward_len], train_dataset=ROWS[8:],
            eval_dataset=ROWS[:8], overrides=RUN + [f"run_dir={run}"]).train()
    recs = records(run)
    # held-out evaluation at rounds 0 and 2 (8 prompts: 2 samples, then greedy; one call per prompt) around 2 rounds
    # of 4 groups of 4
    phases = [(0, 8, 2), (8, 16, 1), (16, 20, 4), (20, 24, 4), (24, 32, 2), (32, 40, 1)]
    assert [len(c) for c in seen] == [g for a, b, g in phases for _ in range(a, b)]
    held, greedy, r1, r2, held2, greedy2 = [sum(-abs(20 - len(c)) for g in seen[a:b] for c in g) / ((b - a) * n)
                                            for a, b, n in phases]
    assert recs[0]["heldout_accuracy"] == pytest.approx(held, abs=1e-12) and held < 0  # unclamped, as TRL sums it
    assert recs[0]["heldout_greedy_accuracy"] == pytest.approx(greedy, abs=1e-12)
    assert [r["rewards/reward_len"] for r in recs[1:]] == pytest.approx([r1, r2], abs=1e-12)
    assert (recs[2]["heldout_accuracy"], recs[2]["heldout_greedy_accuracy"]) == pytest.approx((held2, greedy2),
                                                                                             abs=1e-12)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reference"] == "" for s in samples)
    # the card names no eval command: trustbatch eval takes one scorer, not the run's reward functions
    from trustbatch.recipes.export import eval_command

    cfg = load_config(run / "config.yaml")
    assert cfg.data.format == "auto" and eval_command(cfg, tmp_path / "export", 2) is None


def _prompts_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return f


@pytest.mark.parametrize("args, says", [
    ([], "this data has prompts and no answers"),  # the data's scorer is none: a reward must be given
    (["reward.name=math"], "reward 'math' compares with a gold answer, but this data has none"),
    (["reward.functions=[{name: scorers_for_tests:digit_fraction}]", "model.path="],
     "the default base (warmed up on the data's answers) needs answers to learn from"),
])
def test_what_prompts_alone_cannot_do_is_one_line(tmp_path, shared_dir, support_on_pythonpath, monkeypatch, capsys,
                                                 args, says):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    model = [] if "model.path=" in args else [f"model.path={shared_dir / 'models' / 'stories260K-hf'}"]
    code, _, err = main_in_process(monkeypatch, capsys, "train", f"data={_prompts_file(tmp_path)}", *RUN, *model,
                                   *(a for a in args if a != "model.path="), f"run_dir={tmp_path / 'run'}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0], err


def test_sft_and_eval_of_prompts_alone_are_one_line(tmp_path, shared_dir, monkeypatch, capsys):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    f = _prompts_file(tmp_path)
    code, _, err = main_in_process(monkeypatch, capsys, "sft", f"data={f}", "data.heldout_size=8")
    assert code == 2 and "trustbatch sft needs answers to learn from" in err, err
    code, _, err = main_in_process(monkeypatch, capsys, "eval", "--model", shared_dir / "models" / "stories260K-hf",
                                   "-b", f)
    assert code == 2 and "has prompts and no answers" in err and "--reward" in err, err
    with pytest.raises(UserError, match="needs answers to learn from"):  # no model.path: the default base
        from trustbatch.recipes import prepare_run

        prepare_run(load_config(None, [f"data={f}", "data.heldout_size=8"]))


def test_a_held_out_file_of_prompts_alone_is_scored_by_the_reward_functions(tmp_path, shared_dir):
    """With answered training rows, a data.heldout of prompts alone took the training data's scorer (math against
    empty answers: held-out accuracy 0, no word); now the reward functions score it, or the start is refused."""
    from trustbatch.recipes.build import configured_task, reward_spec

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) + "\n"
                             for i in range(20)))
    base = [f"data={train}", f"data.heldout={_prompts_file(tmp_path)}", "data.heldout_size=8"]
    functions = ["reward.functions=[{name: scorers_for_tests:digit_fraction, weight: 2.0}]"]
    cfg = load_config(None, base + functions)
    task = configured_task(cfg)
    assert reward_spec(cfg, task).name == reward_spec(cfg, task, heldout=True).name == (
        ("scorers_for_tests:digit_fraction", 2.0),)
    cfg = load_config(None, base)
    assert reward_spec(cfg, configured_task(cfg)).name == "math"  # training: its own answers
    with pytest.raises(UserError, match="the held-out data has prompts and no answers"):
        reward_spec(cfg, configured_task(cfg), heldout=True)
    # a reward model alone scores training, and held-out evaluation is refused saying so (it said "no reward given")
    cfg = load_config(None, [f"data={_prompts_file(tmp_path)}", "data.heldout_size=8",
                             f"reward.model={shared_dir / 'models' / 'stories260K-hf'}"])
    assert reward_spec(cfg, configured_task(cfg)).name[0][0].startswith("rm:")
    with pytest.raises(UserError, match="a reward model alone scores training, not held-out evaluation"):
        reward_spec(cfg, configured_task(cfg), heldout=True)


def test_trl_keyword_only_rewards_and_mixed_rows(tmp_path):
    """TRL calls every reward function with keywords: ``f(**kwargs)`` is batch form (it was called as
    f(completion, reference) and failed every time); a file whose first row has no answer and a later row one is
    refused (the later answers were read as a column, scored by nobody)."""
    from trustbatch.data.benchmarks import load_benchmark
    from trustbatch.rewards.scorers import takes_batch

    def keywords(**kwargs):
        return [len(c) for c in kwargs["completions"]]

    def scorer(completion, reference, **kwargs):
        return 1.0

    def wrapper(*args, **kwargs):  # ambiguous: read as the per-completion form it can be called as
        return 1.0

    assert [takes_batch(f) for f in (keywords, scorer, wrapper)] == [True, False, False]
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "answer": "2"}) + "\n")
    with pytest.raises(UserError, match="line 2: the row has an answer field 'answer' but the file's first row has "
                                        "none"):
        load_benchmark(str(f))
