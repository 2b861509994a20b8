"""A configuration users can discover: the generated docs/config.md, ``train --print-config``, ``train --help``, and
"did you mean" for an unknown key (issue 37 item 5)."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Annotated, Literal

import pytest
import yaml
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from trustbatch import config_doc
from trustbatch.cli import app
from trustbatch.config import Config, config_fields, load_config
from trustbatch.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_is_what_the_models_generate():
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert page == config_doc.render(), f"docs/config.md is out of date with trustbatch.config; run `{config_doc.COMMAND}`"


def test_every_key_has_a_description():
    bare = [key for key, field, subs in config_fields() if not subs and not (field.description or "").strip()]
    assert not bare, f"config keys without a description (Field(..., description=...)): {bare}"


class _Inner(BaseModel):
    """Inner ``section``.

    Not on the page."""

    r: Annotated[int, Field(ge=1)] = Field(16, description="rank")


class _Sec(BaseModel):
    """A section."""

    mode: Literal["a", "b"] = Field("a", description="x | y")
    size: int | None = Field(None, gt=0, lt=1, description="a fraction")
    inner: _Inner | None = Field(None, description="optional inner")
    names: list[str] = Field(default_factory=list, description="names")


class _Top(BaseModel):
    sec: _Sec = Field(default_factory=_Sec)
    seed: int = Field(3, description="the seed")


def test_render_on_a_small_model_written_out_by_hand(monkeypatch):
    monkeypatch.setattr(config_doc, "config_fields", lambda: config_fields(_Top))
    header = "| key | type | default | description |\n|---|---|---|---|"
    expected = (
        f"## `sec`\n\nA section.\n\n{header}\n"
        "| `sec.mode` | `a` or `b` | `a` | x \\| y |\n"
        "| `sec.size` | int > 0, < 1 or null | `null` | a fraction |\n"
        "| `sec.inner` | section or null | `null` | optional inner |\n"
        "| `sec.inner.r` | int ≥ 1 | `16` | rank |\n"
        "| `sec.names` | list of str | `[]` | names |\n\n"
        f"## top level\n\n{header}\n"
        "| `seed` | int | `3` | the seed |\n"
    )
    page = config_doc.render()
    assert page.endswith(expected), page


def test_type_names():
    assert config_doc.type_name(typing.Optional[Annotated[int, "x"]]) == "int or null"
    assert config_doc.type_name(dict[str, int]) == "mapping"
    assert config_doc.type_name(str | dict[str, int]) == "str or mapping"


def test_the_page_names_defaults_that_follow_the_task():
    from trustbatch.data.tasks import TASK_DEFAULTS

    assert TASK_DEFAULTS["chain_sum_steps"]["rollout.max_new_tokens"] == 40
    row = next(l for l in config_doc.render().splitlines() if l.startswith("| `rollout.max_new_tokens` |"))
    assert row.startswith("| `rollout.max_new_tokens` | int ≥ 1 | `8` |") and "chain_sum_steps: `40`" in row


@pytest.mark.parametrize("override, unknown, near", [
    ("train.step=3", "train.step", "train.steps"),
    ("trian.steps=3", "trian", "train"),  # a whole unknown section is the unknown key
    ("rollout.lr=0.1", "rollout.lr", "train.lr"),  # a key of that name in another section
    ("model.lora.rr=4", "model.lora.rr", "model.lora.r"),  # inside an optional section
    ("objective.option={}", "objective.option", "objective.options"),
])
def test_an_unknown_key_names_the_nearest_one(override, unknown, near):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert f"unknown config key '{unknown}'; did you mean '{near}'?" in msg and "\n" not in msg
    assert "docs/config.md" in msg


def test_an_unknown_key_with_no_near_one_gets_no_guess():
    with pytest.raises(UserError) as e:
        load_config(None, ["zzzz=1"])
    assert "did you mean" not in str(e.value) and "unknown config key 'zzzz'" in str(e.value)


def test_print_config_resolves_file_and_overrides_and_touches_nothing(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("train: {lr: 1.0e-5}\ntask: {name: chain_sum_steps}\n")
    run_dir = tmp_path / "run"
    args = ["train", "--print-config", "--config", str(cfg_file), "train.steps=7", f"run_dir={run_dir}"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    printed = yaml.safe_load(res.output)
    assert printed["train"]["steps"] == 7 and printed["train"]["lr"] == 1e-5  # override, file
    assert printed["rollout"]["max_new_tokens"] == 40  # chain_sum_steps' default, resolved
    assert printed["objective"]["name"] == "p3o" and printed["run_dir"] == str(run_dir)  # defaults
    assert set(printed) == set(Config.model_fields)
    assert not run_dir.exists()
    # the printed YAML is a config file that resolves to the same configuration
    again = tmp_path / "printed.yaml"
    again.write_text(res.output)
    assert load_config(again) == load_config(cfg_file, ["train.steps=7", f"run_dir={run_dir}"])


def test_print_config_of_a_resume_reads_the_saved_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 5, "lr": 0.002}, "run_dir": str(run)}))
    before = sorted(p.name for p in run.iterdir())
    res = CliRunner().invoke(app, ["train", "--print-config", "--resume", str(run), "train.steps=9"])
    assert res.exit_code == 0, res.output
    printed = yaml.safe_load(res.output)
    assert printed["train"]["steps"] == 9 and printed["train"]["lr"] == 0.002
    assert sorted(p.name for p in run.iterdir()) == before  # no lock file, no log, no checkpoint


def test_train_help_lists_every_section_and_the_reference():
    res = CliRunner().invoke(app, ["train", "--help"], terminal_width=200)
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert "--print-config" in text
    listing = text.split("Configuration sections", 1)[1].split("docs/config.md", 1)[0]
    named = {w.strip(".") for w in re.findall(r"[\w.]+", listing)}
    missing = [key for key, _, _ in config_fields() if "." not in key and key not in named]
    assert not missing, f"top-level config keys `train --help` does not name: {missing}"
