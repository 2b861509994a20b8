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
