"""What a user writes reaches the run as written: a YAML file equals the same keys on the command line, a ``Config``
given to the Python API keeps the defaults that follow the data, and keys nothing would read are refused in one line.
"""

import json
import re

import numpy as np
import pytest
import yaml

from trustbatch.api import Trainer
from trustbatch.config import load_config
from trustbatch.config.sections import LoraConfig
from trustbatch.data.benchmarks import benchmark_kind
from trustbatch.errors import UserError
from trustbatch.recipes.defaults import with_answer_budget


def test_an_empty_mapping_in_yaml_sets_a_section_to_its_defaults_as_on_the_command_line(tmp_path):
    """``model: {lora: {}}`` was dropped, so the run did full fine-tuning where ``model.lora={}`` trains LoRA."""
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  lora: {}\ntrain: {}\n")
    from_yaml = load_config(str(f), ["train.steps=3"])
    assert from_yaml.model.lora == LoraConfig() == load_config(None, ["model.lora={}"]).model.lora
    assert from_yaml.train.steps == 3


@pytest.mark.parametrize("args, message", [
    (["data.heldout=h.jsonl"], "data.heldout needs data.train"),
    (["data.train=t.jsonl", "data.format=math", "data.prompt_field=q"],
     "data.prompt_field is read only for plain rows, not data.format=math"),
    (["data.train=t.jsonl", "data.format=gsm8k", "data.answer_field=a"],
     "data.answer_field is read only for plain rows, not data.format=gsm8k"),
    # the reasoning-gym task evaluated its own 256 held-out prompts, not 8
    (["data.heldout_size=8"], "data.heldout_size is read only with data.train .* use task.heldout_size"),
    (["data.train_size=50"], "data.train_size is read only with data.train .* use task.train_size"),
    (["data.format=math"], "data.format is read only with data.train .* drop data.format"),
    (["objective.advantage=rloo", "objective.std=sample"], "objective.advantage=rloo divides by none"),
    (["objective.advantage=mean", "objective.std=sample"], "objective.advantage=mean divides by none"),
    # the data file is the task: the run evaluated 256 held-out rows
    (["data.train=t.jsonl", "task.heldout_size=64"],
     r"^task.heldout_size is read only without data.train \(the data file is the task\); use data.heldout_size$"),
    (["data.train=t.jsonl", "task.name=leg_counting"], r"^task.name is read only without data.train .*; drop task.name$"),
    # torch's AdamW refused it with a traceback, after the run directory was made
    (["train.adam_betas=[1.0, 0.99]"], r"^invalid value for 'train.adam_betas.0': Input should be less than 1"),
    (["train.adam_betas=[0.9, -0.1]"], r"^invalid value for 'train.adam_betas.1': Input should be greater than or"),
    # 16 rows in 20 optimizer steps: steps without a row
    (["train.minibatches=20", "rollout.prompts_per_step=2", "rollout.group_size=8"],
     r"^train.minibatches=20 splits a round of 16 completions .* set train.minibatches ≤ 16$"),
])
def test_keys_nothing_would_read_are_refused_in_one_line(args, message):
    with pytest.raises(UserError, match=message) as e:
        load_config(None, args)
    assert "\n" not in str(e.value)
    load_config(None, ["data.train=t.jsonl", "data.format=jsonl", "data.prompt_field=q", "data.heldout=h.jsonl",
                       "data.heldout_size=8", "data.train_size=50"])
    load_config(None, ["objective.std=sample", "data.heldout_size=256"])  # zscore's σ; a default value reads alike


def test_a_config_object_given_to_the_api_keeps_the_defaults_that_follow_the_data(shared_dir, tmp_path):
    """``Trainer(config=Config)`` read every default as set: GSM8K trained at 8 new tokens, not its 512, and
    ``chain_sum_steps`` on 2-3 term problems, not its own 4. What was set in the Config, by assignment too, is kept."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 32768}))
    gsm8k = str(shared_dir / "data" / "gsm8k" / "train.jsonl")
    given = Trainer(load_config(None, []), model=model, train_dataset=gsm8k).config
    assert with_answer_budget(given)[0].rollout.max_new_tokens == 512  # test_answer_budget: GSM8K's budget
    steps = Trainer(load_config(None, []), overrides={"task.name": "chain_sum_steps"}).config
    assert steps.task.params == Trainer(overrides={"task.name": "chain_sum_steps"}).config.task.params
    assert steps.task.params["min_terms"] == 4
    cfg = load_config(None, ["rollout.max_new_tokens=7"])
    cfg.train.steps = 12
    kept = Trainer(cfg, train_dataset=gsm8k).config
    assert (kept.rollout.max_new_tokens, kept.train.steps) == (7, 12)


def test_the_api_takes_python_values_and_refuses_what_is_not_a_value_in_one_line(tmp_path):
    def f(completion, reference):
        return 0.0

    one = Trainer(reward_funcs=f, reward_weights=0.5,
                  overrides={"train.steps": np.int64(5), "rollout.temperature": np.float32(0.5),
                             "run_dir": tmp_path / "run"}).config
    assert ([t.weight for t in one.reward.functions], one.train.steps, one.rollout.temperature, one.run_dir) == \
        ([0.5], 5, 0.5, str(tmp_path / "run"))
    for kw, message in ((dict(reward_funcs=[f, f], reward_weights=[1.0, "x"]), "reward weight 'x' is a str"),
                        (dict(reward_funcs=[f, f], reward_weights=[1.0]), "1 reward_weights for 2 reward_funcs"),
                        (dict(overrides={"train.steps": {1, 2}}), "cannot be a config value"),
                        (dict(reward_funcs=3), "is not callable"),
                        # a mistyped resume path is named, not blamed on the reward functions' count
                        (dict(resume=tmp_path / "no-such-run", reward_funcs=[f]), "no such directory")):
        with pytest.raises(UserError, match=message) as e:
            Trainer(**kw)
        assert "\n" not in str(e.value)


def test_a_section_shaped_override_or_config_dict_sets_keys_inside_the_section(tmp_path):
    """``overrides={"reward": {"workers": 0}}`` means reward.workers=0, as ``reward: {workers: 0}`` in a YAML file:
    set whole it replaced the section and dropped the reward function, the model and the data the keyword arguments
    had set (the run trained on the data's built-in scorer)."""
    def f(completion, reference):
        return 0.0

    rows = [{"prompt": "1 + 1 =", "answer": "2"}] * 3
    cfg = Trainer(model=tmp_path / "m", reward_funcs=[f], train_dataset=rows,
                  overrides={"reward": {"workers": 0}, "model": {"sft_steps": 3}, "data": {"heldout_size": 2}}).config
    assert [t.name for t in cfg.reward.functions] == [Trainer(reward_funcs=[f]).config.reward.functions[0].name]
    assert (cfg.reward.workers, cfg.model.path, cfg.model.sft_steps, cfg.data.heldout_size) == \
        (0, str(tmp_path / "m"), 3, 2) and cfg.data.train.endswith(".jsonl")
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("train: {steps: 4}\nrollout: {group_size: 3}\n")
    from_dict = Trainer({"train": {"steps": 4}, "rollout.group_size": 3}, reward_funcs=[f]).config
    assert from_dict == Trainer(yaml_file, reward_funcs=[f]).config


def test_a_pandas_dataframe_is_read_as_its_rows(tmp_path):
    pandas = pytest.importorskip("pandas")
    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "2 + 2 =", "answer": "4"}]
    a = Trainer(train_dataset=pandas.DataFrame(rows)).config.data.train
    assert a == Trainer(train_dataset=rows).config.data.train  # the same rows, the same content-named file


@pytest.mark.parametrize("folder, kind", [("aime2024", "aime"), ("amc_23", "amc"), ("train_aime", "aime"),
                                          ("aimee", "math"), ("bob", "math")])
def test_the_competition_is_read_from_the_files_own_name_or_folder(tmp_path, folder, kind):
    """A MATH-format file under a user's folder named aimee was budgeted as AIME (20,480 tokens)."""
    f = tmp_path / "users" / folder / "test.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    assert benchmark_kind(str(f)) == kind


def test_a_heldout_file_is_scored_by_its_own_scorer_in_training_as_eval_scores_it(shared_dir):
    """GSM8K to train, MATH-500 held out: training's held-out evaluation scored MATH answers with the gsm8k scorer
    (a correct \\boxed{p - q} scored 0), while the card's ``trustbatch eval -b`` scored them with math."""
    from trustbatch.recipes.build import configured_task, reward_spec

    cfg = load_config(None, [f"data.train={shared_dir / 'data' / 'gsm8k' / 'train.jsonl'}",
                             f"data.heldout={shared_dir / 'data' / 'math500' / 'test.jsonl'}", "data.heldout_size=8"])
    task = configured_task(cfg)
    assert reward_spec(cfg, task).name == "gsm8k"  # training scores the training data by its own
    assert reward_spec(cfg, task, heldout=True).name == benchmark_kind(str(shared_dir / "data" / "math500" / "test.jsonl"))
    named = load_config(None, [f"data.train={cfg.data.train}", f"data.heldout={cfg.data.heldout}", "reward.name=gsm8k"])
    assert reward_spec(named, task, heldout=True).name == "gsm8k"  # a reward.name the user set scores both


def test_training_rollouts_keep_the_training_datas_scorer_beside_a_heldout_file_of_another(shared_dir):
    """The sync source reused the run's pool, the held-out one: once the held-out file got its own scorer, GSM8K
    rollouts were scored by math ('#### 72' with working after it scored 0)."""
    from trustbatch.recipes.build import build_parts, prepare_run, scoring_check

    cfg = load_config(None, [f"data.train={shared_dir / 'data' / 'gsm8k' / 'train.jsonl'}",
                             f"data.heldout={shared_dir / 'data' / 'math500' / 'test.jsonl'}", "data.heldout_size=8",
                             f"model.path={shared_dir / 'models' / 'stories260K-hf'}", "reward.workers=0",
                             "rollout.max_new_tokens=16", "train.steps=1"])
    task, policy, pool, _ = prepare_run(cfg)
    source = build_parts(cfg, task, policy, pool, check_round=scoring_check(cfg, task, None)).parts.source
    assert (pool.name, source.pool.name) == ("math", "gsm8k")
    assert source.pool.score(["#### 72\nCheck: 48 + 24 = 72"], ["72"]).rewards == [1.0]  # gsm8k: the number after ####
    source.pool.close()


def test_a_saved_config_reads_back_as_it_was_with_strings_that_look_like_exponent_floats(tmp_path):
    """config.yaml is read with exponent floats (``3e-1``); it was written by ``yaml.safe_dump``, which leaves the
    string ``1e5`` unquoted, so a run_dir or system prompt ``1e5`` came back as 100000.0 and the resume was refused.
    The reference: the values as set, read back the way a resume reads config.yaml."""
    from trustbatch.config import dump_config, read_yaml_file
    from trustbatch.lab.experiment import Experiment

    texts = {"run_dir": "1e5", "data.system_prompt": "2E-3", "model.revision": "+7e10"}
    cfg = load_config(None, [f"{k}='{v}'" for k, v in texts.items()] + ["task.params={tag: '1e3', scale: 1e3}"])
    assert (cfg.run_dir, cfg.data.system_prompt, cfg.model.revision) == tuple(texts.values())
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    again = load_config(None, [], base=read_yaml_file(tmp_path / "config.yaml", what="the run's config"))
    assert again == cfg and again.task.params["tag"] == "1e3" and again.task.params["scale"] == 1000.0
    # the lab writes an arm's values as override text the same way
    exp = Experiment(name="x", description="", arms={"a": {"data.system_prompt": "1e5", "train.lr": 1e-3}},
                     seeds=[0])
    assert load_config(None, exp.overrides("a", 0)).data.system_prompt == "1e5"


def test_a_printed_config_read_back_takes_overrides_as_the_defaults_do(tmp_path):
    """--print-config's file writes an unset section as null (model.lora: null): an override inside it was refused
    as "'lora' is not a section"; and a section given twice in a YAML file kept only its last copy."""
    from trustbatch.config import dump_config

    printed = tmp_path / "printed.yaml"
    printed.write_text(dump_config(load_config()))
    assert load_config(printed, ["model.lora.r=8"]) == load_config(None, ["model.lora.r=8"])
    twice = tmp_path / "twice.yaml"
    twice.write_text("train: {steps: 2, lr: 0.001}\nrollout: {group_size: 4}\ntrain: {epochs: 2}\n")
    with pytest.raises(UserError, match=r"line 3.*found the key 'train' twice \(first at line 1\)") as e:
        load_config(twice)
    assert "\n" not in str(e.value)


def test_a_run_saved_with_task_keys_beside_its_data_file_still_resumes(tmp_path):
    """Those keys did nothing then either: a saved config with them reads back (``as_read_now``) with the task's
    defaults, as the run computed."""
    from trustbatch.config import dump_config
    from trustbatch.recipes.rundir import as_read_now

    saved = yaml.safe_load(dump_config(load_config(None, ["data.train=t.jsonl"])))
    saved["task"]["heldout_size"] = 64
    with pytest.raises(UserError):
        load_config(None, base=saved)
    assert load_config(None, base=as_read_now(saved)) == load_config(None, ["data.train=t.jsonl"])
    # more mini-batches than a round's completions: the steps with rows are the ones such a run now takes
    saved = yaml.safe_load(dump_config(load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=4"])))
    saved["train"]["minibatches"] = 16
    assert load_config(None, base=as_read_now(saved)).train.minibatches == 8


UNREAD = [  # (a key set alone, a key that turns its option on), each read only with the other
    ("rollout.max_sampling_rounds=8", "rollout.dynamic_sampling=true"),
    ("rollout.foreign_model={hidden: 96}", "rollout.foreign_fraction=0.5"),
    ("ray_learners=0", "orchestrator=ray"),
    ("ray_address=host:6379", "orchestrator=ray"),
    ("train.ess_scope=micro_batch", "objective.name=p3o"),
]


@pytest.mark.parametrize("key,option", UNREAD, ids=[u[0].split("=")[0] for u in UNREAD])
def test_a_key_whose_option_is_off_is_refused_and_an_old_run_with_it_still_resumes(key, option):
    """Each of these keys was accepted and read by nothing while its option was off (max_sampling_rounds=8 without
    dynamic sampling trained as 1 sampling call a batch; an ESS scope under GRPO measured nothing). The reference:
    the run reads nothing of it, so the config it computes equals the defaults'; with its option on, it is kept."""
    from trustbatch.config import dump_config
    from trustbatch.recipes.build import preflight
    from trustbatch.recipes.rundir import as_read_now

    alone = [key] + (["objective.name=grpo"] if key.startswith("train.ess_scope") else [])
    with pytest.raises(UserError, match=rf"{re.escape(key.split('=')[0])}.* read only .*drop") as e:
        preflight(load_config(None, alone)) if key.startswith("train.") else load_config(None, alone)
    assert "\n" not in str(e.value)
    with_option = load_config(None, [key, option] + (["rollout.mode=async"] if option.startswith("orch") else []))
    assert dump_config(with_option) != dump_config(load_config(None, [option] + (
        ["rollout.mode=async"] if option.startswith("orch") else [])))
    # a saved config.yaml that holds it (an older version let it through) reads back as what that run computed
    saved = yaml.safe_load(dump_config(load_config(None, alone[1:])))
    section, _, name = key.split("=")[0].rpartition(".")
    (saved[section] if section else saved)[name] = yaml.safe_load(key.split("=", 1)[1])
    assert load_config(None, base=as_read_now(saved)) == load_config(None, alone[1:])


@pytest.mark.parametrize("text", ["Solve it. End with #### N", "runs/exp #2", "a # b # c", "#1 rule"])
def test_an_override_keeps_its_hash_and_what_follows(text):
    """YAML read ' #' on as a comment: data.system_prompt='End with #### N' arrived as 'End with' (rc 0), a
    run_dir 'runs/exp #2' as 'runs/exp'. A command-line value holds no comment: the reference is the text as typed."""
    cfg = load_config(None, [f"data.system_prompt={text}", f"run_dir={text}"])
    assert (cfg.data.system_prompt, cfg.run_dir) == (text, text)
    # YAML still reads every other value: a mapping holding a '#', numbers, quotes
    cfg = load_config(None, ["task.params={tag: 'a #1', size: 3}", "train.lr=1e-3", "data.system_prompt='q # x'"])
    assert (cfg.task.params["tag"], cfg.task.params["size"], cfg.train.lr) == ("a #1", 3, 1e-3)
    assert cfg.data.system_prompt == "q # x"


def test_text_yaml_reads_as_another_type_says_to_quote_it():
    with pytest.raises(UserError, match=r"""\(got \{'Answer': 'briefly'\}\); quote a text value for YAML: """
                                        r""""data.system_prompt='...'"$"""):
        load_config(None, ["data.system_prompt=Answer: briefly"])
