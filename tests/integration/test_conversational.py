"""TRL's conversational format: a row's prompt as chat messages, rendered by the tokenizer's chat template, and a
batch-form reward function called as TRL's GRPOTrainer calls it (the prompts as messages, each completion as
``[{"role": "assistant", "content": text}]``). References: the template worked by hand, and TRL's shapes."""

import json
import pickle
import shutil

import pytest
from transformers import AutoTokenizer

from trustbatch.api import Trainer
from trustbatch.chat import Conversation, conversation
from trustbatch.errors import UserError

from runproc import records

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
SYSTEM = {"role": "system", "content": "Answer with a number."}
ROWS = [{"prompt": ([SYSTEM] if i % 2 else []) + [{"role": "user", "content": f"What is {i} plus {i % 5}?"}],
         "answer": str(i + i % 5), "level": i % 3} for i in range(40)]
RUN = ["reward.workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
       "train.steps=2", "eval.every=2", "eval.samples_per_prompt=2", "data.heldout_size=8", "threads=1"]


@pytest.fixture
def chat_model(tmp_path, shared_dir):
    path = tmp_path / "chat-model"
    shutil.copytree(shared_dir / "models" / "stories260K-hf", path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def test_a_conversation_is_its_text_keeps_its_messages_and_refuses_what_no_model_answers():
    c = conversation(ROWS[1]["prompt"], "row 2")
    assert c == "system: Answer with a number.\nuser: What is 1 plus 1?" and c.as_list() == ROWS[1]["prompt"]
    again = pickle.loads(pickle.dumps(c))  # to reward and rollout workers
    assert isinstance(again, Conversation) and again.messages == c.messages and again == c
    for bad, says in (([{"role": "tool", "content": "x"}], "role 'tool'"),
                      ([{"role": "user", "content": ["x"]}], "not text"),
                      ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                       "the last message is the assistant's")):
        with pytest.raises(UserError, match=says):
            conversation(bad, "row 3")


def test_trl_conversational_rows_train_through_the_api_with_trl_shaped_rewards(tmp_path, chat_model):
    calls = []

    def short_answer(prompts, completions, answer, level, **kwargs):  # written for TRL: completion[0]["content"]
        calls.append((prompts, completions, answer, level))
        return [1.0 if len(c[0]["content"]) < 12 else -0.5 for c in completions]

    run = tmp_path / "run"
    Trainer(model=chat_model, reward_funcs=[short_answer], train_dataset=ROWS[8:], eval_dataset=ROWS[:8],
            overrides=RUN + [f"run_dir={run}", "data.system_prompt=Be brief."]).train()
    rounds = [r for r in records(run) if r["step"] > 0]
    assert len(rounds) == 2 and len(calls) == 2 * 4  # one call per group of 4
    by_prompt = {conversation(r["prompt"], ""): r for r in ROWS}
    for prompts, completions, answer, level in calls:
        row = by_prompt[Conversation(prompts[0])]
        assert prompts == [row["prompt"]] * 4 and answer == [row["answer"]] * 4 and level == [row["level"]] * 4
        assert all(isinstance(c, list) and len(c) == 1 and set(c[0]) == {"role", "content"}
                   and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    for k, rec in enumerate(rounds):
        got = [v for _, completions, _, _ in calls[4 * k:4 * (k + 1)]
               for v in (1.0 if len(c[0]["content"]) < 12 else -0.5 for c in completions)]
        assert rec["rewards/short_answer"] == pytest.approx(sum(got) / 16, abs=1e-12)
    # the prompts the policy sampled from: the row's messages through the template, data.system_prompt only where a
    # row has no system message of its own
    from trustbatch.config import load_config
    from trustbatch.recipes import prepare_run

    tok = AutoTokenizer.from_pretrained(chat_model)
    cfg = load_config(run / "config.yaml", ["run_dir=" + str(tmp_path / "other")])
    task, policy, pool, _ = prepare_run(cfg)
    pool.close()
    for e in task.train[:4]:
        system = "" if "[system]" in "".join(f"[{m['role']}]" for m in e.prompt.messages) else "[system] Be brief.\n"
        by_hand = system + "".join(f"[{m['role']}] {m['content']}\n" for m in e.prompt.messages) + "[assistant] "
        assert policy.encode_prompt(e.prompt) == tok(by_hand, add_special_tokens=False)["input_ids"]
    logged = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert logged and all(s["prompt"] in set(by_prompt) for s in logged if "prompt" in s)


def test_conversational_rows_without_a_chat_template_are_one_line(tmp_path, shared_dir):
    with pytest.raises(UserError, match="needs the tokenizer's chat template"):
        Trainer(model=shared_dir / "models" / "stories260K-hf", reward_funcs=["math"], train_dataset=ROWS[8:],
                eval_dataset=ROWS[:8], overrides=RUN + [f"run_dir={tmp_path / 'run'}"]).train()


def test_a_reward_model_scores_a_conversation_through_its_own_template(chat_model, shared_dir):
    """It scored the prompt's role: content log text plus the completion; TRL renders prompt + [assistant
    completion] with the reward model's chat template. Reference: that template worked by hand."""
    import torch

    from trustbatch.policy.reward_model import RewardModel

    rm = RewardModel(torch.nn.Linear(1, 1), AutoTokenizer.from_pretrained(chat_model), name="rm")
    ctx = [{"prompt": conversation(ROWS[1]["prompt"], "")}, {"prompt": "plain "}]
    assert rm.texts(["2", "text"], ctx) == [
        "[system] Answer with a number.\n[user] What is 1 plus 1?\n[assistant] 2\n[assistant] ", "plain text"]
    plain = RewardModel(torch.nn.Linear(1, 1), AutoTokenizer.from_pretrained(shared_dir / "models" / "stories260K-hf"),
                        name="rm")
    with pytest.raises(UserError, match="reward model 'rm' has no chat template"):
        plain.texts(["2"], ctx[:1])


def test_a_dataframe_of_conversational_rows_keeps_their_messages(tmp_path):
    """pandas holds a list cell as a NumPy array, which the rows' JSON wrote as its repr: the model trained on
    "[{'role': 'user', ...}]" as text. Reference: the rows as given."""
    pd = pytest.importorskip("pandas")
    from trustbatch.api import _as_file
    from trustbatch.data.benchmarks import load_benchmark

    pd.DataFrame(ROWS).to_parquet(tmp_path / "rows.parquet")
    frame = pd.read_parquet(tmp_path / "rows.parquet")
    assert type(frame["prompt"][0]).__module__ == "numpy"  # what made the repr
    examples = load_benchmark(_as_file(frame, "train_dataset")).examples
    assert [list(e.prompt.messages) for e in examples] == [r["prompt"] for r in ROWS]


def test_a_template_that_refuses_a_rows_messages_is_one_line(tmp_path, chat_model):
    """Gemma's template raises on a system message: a row's own one was a jinja2 traceback (data.system_prompt's
    already was one line)."""
    tok = AutoTokenizer.from_pretrained(chat_model)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    tok.save_pretrained(chat_model)
    with pytest.raises(UserError, match=r"refuses a prompt's messages \(TemplateError: System role not supported\), "
                                        r"roles \['system', 'user'\]"):
        Trainer(model=chat_model, reward_funcs=["math"], train_dataset=ROWS[8:], eval_dataset=ROWS[:8],
                overrides=RUN + [f"run_dir={tmp_path / 'run'}"]).train()


def test_messages_sends_text_prompts_as_they_are_through_a_resume(tmp_path, chat_model):
    """data.chat_template=messages (TRL's rule) on TRL's quickstart rows (text prompts, a chat model): the prompts go
    untemplated, and a resume keeps them so (the checkpoint's policy took the run's framing; without it the resumed
    rounds templated them). Reference: the uninterrupted run's weights, and a run that templates them, which differ."""
    from runproc import assert_same_weights

    rows = [{"prompt": f"Once upon a time, a cat named Tom {i}"} for i in range(40)]

    def reward_len(completions, **kwargs):
        return [-abs(8 - len(c)) for c in completions]

    def run(name, steps, mode="messages", resume=None):
        over = [*RUN, f"train.steps={steps}", "checkpoint_every=1",
                f"data.chat_template={mode}", f"run_dir={tmp_path / name}"]
        if resume:
            return Trainer(resume=tmp_path / name, reward_funcs=[reward_len], overrides={"train.steps": steps}).train()
        Trainer(model=chat_model, reward_funcs=[reward_len], train_dataset=rows[8:], eval_dataset=rows[:8],
                overrides=over).train()

    run("whole", 2)
    run("resumed", 1)
    run("resumed", 2, resume=True)
    final = "checkpoints/step_000002"
    assert_same_weights(tmp_path / "whole" / final, tmp_path / "resumed" / final)
    run("templated", 2, mode="auto")
    with pytest.raises(AssertionError, match="weights differ"):
        assert_same_weights(tmp_path / "whole" / final, tmp_path / "templated" / final)
    from trustbatch.recipes.export import export_run  # the card says how the prompts went

    export_run(tmp_path / "resumed", tmp_path / "export")
    assert "and text prompts as they are (TRL's rule)" in (tmp_path / "export" / "README.md").read_text()


def test_the_api_frames_trls_prompt_rows_as_trl_does(tmp_path, chat_model):
    """TRL's quickstart through the API (text prompts in a ``prompt`` column, a chat model): TRL's framing, unless
    the caller sets one; trustbatch's own formats (a GSM8K row) keep the command line's."""
    text = [{"prompt": f"Once upon a time, a cat named Tom {i}"} for i in range(12)]
    gsm = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(12)]
    for rows, over, framing in ((text, {}, "messages"), (ROWS, {}, "messages"), (text, {"data.chat_template": "auto"},
                                "auto"), (gsm, {}, "auto"), (text, {"data.prompt_field": "prompt"}, "auto"),
                                (ROWS, {"data.system_prompt": "Be brief."}, "auto")):
        cfg = Trainer(model=chat_model, reward_funcs=["gsm8k"], train_dataset=rows, overrides=over).config
        assert cfg.data.chat_template == framing, (rows[0], over)


def test_a_prompt_column_of_messages_falls_back_to_the_question_where_no_template_frames_it(tmp_path, shared_dir,
                                                                                              capsys):
    """GSM8K rows with a chat-message prompt column (a TRL script's) on a model without a chat template (the
    default base, a base model): the column made every run fail in one line; each row now falls back to its
    question and the format's instruction, as before the column was read, with a warning."""
    from rich.console import Console

    from trustbatch.config import load_config
    from trustbatch.data.benchmarks import GSM8K_INSTRUCTION
    from trustbatch.recipes.build import prepare_run

    f = tmp_path / "gsm.jsonl"
    f.write_text("".join(json.dumps({"question": f"Tom has {i} apples and gets 1.", "answer": f"#### {i + 1}",
                                     "prompt": [{"role": "user", "content": f"Tom: {i} + 1?"}]}) + "\n"
                         for i in range(20)))
    cfg = load_config(None, [f"data={f}", "data.heldout_size=4", f"model.path={shared_dir / 'models' / 'stories260K-hf'}",
                             "reward.workers=0"])
    task, policy, pool, _ = prepare_run(cfg, Console(stderr=True, width=400))
    pool.close()
    assert [e.prompt for e in task.heldout] == [f"Tom has {i} apples and gets 1." + GSM8K_INSTRUCTION for i in range(4)]
    assert "20 rows' prompt column holds chat messages, which this model cannot frame" in capsys.readouterr().err
    assert policy.encode_prompt(task.train[0].prompt)  # text: no refusal


def _gsm_with_messages(tmp_path, n=30):
    f = tmp_path / "gsm.jsonl"
    f.write_text("".join(json.dumps({"question": f"Tom has {i} apples and gets 1.", "answer": f"#### {i + 1}",
                                     "prompt": [{"role": "user", "content": f"Tom: {i} + 1?"}]}) + "\n"
                         for i in range(n)))
    return f


def test_eval_and_sft_fall_back_to_the_question_as_training_does(tmp_path, shared_dir, monkeypatch, capsys):
    """The fallback ran in training alone: trustbatch eval (the model card's command) and trustbatch sft refused the
    rows that a run trained on. Reference: the prompts training held out."""
    from trustbatch.recipes.evaluate import evaluate
    from runproc import main_in_process

    f = _gsm_with_messages(tmp_path)
    warned: list[str] = []
    res = evaluate(shared_dir / "models" / "stories260K-hf", [str(f)], n=1, ks=[1], max_new_tokens=2, workers=0,
                   limit=4, warn=warned.append)
    assert res["benchmarks"][f.stem]["pass@1"] >= 0 and any("4 rows' prompt column holds chat messages" in w
                                                          for w in warned)
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    code, out, err = main_in_process(monkeypatch, capsys, "sft", f"data={f}", "data.heldout_size=4", "model.sft_steps=2")
    assert code == 0, err
    assert "30 rows' prompt column holds chat messages" in out + err  # the train and held-out rows


def test_a_run_saved_before_the_prompt_column_was_read_resumes_on_its_prompts(tmp_path, chat_model):
    """A run whose config has no data.prompt_column (saved before it) read GSM8K rows' question: its resume kept
    training and evaluating on them (it switched to the prompt column mid-run, under the same metrics)."""
    import yaml

    from trustbatch.config import load_config
    from trustbatch.recipes import train

    f = _gsm_with_messages(tmp_path)
    run = tmp_path / "run"
    over = [f"data={f}", "data.heldout_size=4", f"model.path={chat_model}", "reward.workers=0", "threads=1",
            "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "eval.every=1",
            "eval.samples_per_prompt=1", "checkpoint_every=1", "log.samples.every=1", "log.samples.train=2",
            "log.samples.heldout=2", f"run_dir={run}"]
    train(load_config(None, over + ["train.steps=1", "data.prompt_column=false"]))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["data"]["prompt_column"]  # as a run saved before the key
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    train(resume=str(run), overrides=["train.steps=2"])
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["round"] for s in samples} == {0, 1, 2}
    assert all(s["prompt"].startswith("Tom has ") for s in samples), [s["prompt"][:20] for s in samples]
    from trustbatch.recipes.export import eval_command  # the card's command reads the rows as the run did

    assert "--no-prompt-column" in eval_command(load_config(None, over + ["data.prompt_column=false"]), run, 1)
    assert "--no-prompt-column" not in eval_command(load_config(None, over), run, 1)
