"""YAML 1.1 reads an unquoted ``on``/``off``/``yes``/``no``/``true``/``false`` as a boolean (issue 46 item 5): a key
whose values are words gets the word, a boolean key the boolean, and a refusal quotes what the user typed; through
``trustbatch train --print-config`` (the CLI's own parsing) with overrides and with a config file."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from trustbatch.cli import app
from trustbatch.config import load_config
from trustbatch.errors import UserError


def _printed(*args: str) -> dict:
    res = CliRunner().invoke(app, ["train", "--print-config", *args])
    assert res.exit_code == 0, res.output
    return yaml.safe_load(res.output)


@pytest.mark.parametrize("typed, expected", [("on", "on"), ("off", "off"), ("ON", "on"), ("true", "on"),
                                             ("false", "off"), ("auto", "auto")])
def test_chat_template_takes_on_and_off_unquoted_as_an_override(typed, expected):
    assert _printed(f"data.chat_template={typed}")["data"]["chat_template"] == expected


def test_a_config_file_with_unquoted_words_and_booleans(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  chat_template: on\nrollout:\n  dynamic_sampling: on\n  engine: transformers\n"
                 "task:\n  params: {flag: yes}\nlog:\n  trackers: []\n")
    printed = _printed("--config", str(f))
    assert printed["data"]["chat_template"] == "on"
    assert printed["rollout"]["dynamic_sampling"] is True  # a boolean key keeps YAML's reading
    assert printed["task"]["params"]["flag"] is True  # and so do free-form dicts
    f.write_text("data:\n  chat_template: off\n")
    assert _printed("--config", str(f))["data"]["chat_template"] == "off"


@pytest.mark.parametrize("override, says", [
    ("train.precision=On", "(got 'On')"),  # a key of other words: the word as typed, not True
    ("train.steps=yes", "not the boolean yes (got 'yes')"),  # a number: still refused, quoting the word
    ("train.steps=true", "not the boolean true"),
    ("data.chat_template=yes", "(got 'yes')"),
    ("log.trackers=[off]", "(got 'off')"),
])
def test_a_refusal_quotes_the_word_typed(override, says, tmp_path):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert says in str(e.value) and "True" not in str(e.value) and "False" not in str(e.value), str(e.value)
    key, _, value = override.partition("=")
    section, name = key.split(".")
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    assert says in str(e.value), str(e.value)


def test_booleans_from_python_and_saved_configs_still_work():
    cfg = load_config(None, ["rollout.dynamic_sampling=no", "train.activation_checkpointing=TRUE"])
    assert cfg.rollout.dynamic_sampling is False and cfg.train.activation_checkpointing is True
    # a dict base (a lab seed file, a saved config) may hold real booleans
    assert load_config(None, None, base={"data": {"chat_template": True}}).data.chat_template == "on"
    assert load_config(None, ["run_dir=no"]).run_dir == "no"  # a path named like a boolean is a path
