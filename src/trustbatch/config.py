"""Typed run configuration: defaults, YAML files, ``key=value`` overrides, validation with one-line errors.

    cfg = load_config("examples/chain_sum.yaml", ["objective.name=grpo", "train.steps=50"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import UserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskConfig(_Strict):
    """A reasoning-gym task, generated from ``seed``, split into disjoint train and held-out prompts."""

    name: str = "chain_sum"
    params: dict[str, Any] = Field(default_factory=dict, description="merged over the task's defaults")
    train_size: int = Field(3500, ge=1)
    heldout_size: int = Field(256, ge=1)
    seed: int = 1

    @model_validator(mode="after")
    def _merge_default_params(self) -> "TaskConfig":
        from .data.tasks import DEFAULT_PARAMS

        merged = {**DEFAULT_PARAMS.get(self.name, {}), **self.params}
        if merged != self.params:
            object.__setattr__(self, "params", merged)
        return self


class DataConfig(_Strict):
    """Training data from local files (GSM8K, MATH, AIME, AMC, Countdown or any JSONL); replaces ``task`` when ``train`` is set.

    ``data=FILE`` on the command line is short for ``data.train=FILE``.
    """

    train: str | None = Field(None, description="JSONL file or benchmark name to train on")
    heldout: str | None = Field(None, description="held-out file; default: the first heldout_size train rows, kept out of training")
    dir: str | None = Field(None, description="directory that benchmark names resolve in (default $TRUSTBATCH_DATA)")
    format: Literal["auto", "gsm8k", "math", "countdown", "jsonl"] = "auto"
    prompt_field: str | None = None
    answer_field: str | None = None
    train_size: int | None = Field(None, ge=1, description="use at most this many train rows")
    heldout_size: int = Field(256, ge=1)


class RewardConfig(_Strict):
    """Scoring in worker processes, each completion cut at ``timeout_s`` (reward 0, counted)."""

    name: str | None = Field(None, description="math | gsm8k | countdown | rg:TASK | module:function; default: the data's")
    workers: int = Field(2, ge=0, description="scoring processes; 0 scores in the trainer's process without a time limit")
    timeout_s: float = Field(10.0, gt=0)


class ModelConfig(_Strict):
    """``path`` loads any local HF model directory; without it the default small base is built (and cached)."""

    path: str | None = None
    hidden: int = Field(128, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    vocab_size: int = Field(384, ge=260)
    max_len: int = Field(64, ge=8)
    sft_examples: int | None = Field(None, ge=1, description="demonstrations for SFT: the first N train prompts (None: all)")
    sft_teacher_error: float = Field(
        0.25, ge=0, lt=1, description="fraction of SFT demonstrations whose answer is another prompt's (a weak teacher)"
    )
    sft_steps: int = Field(600, ge=0)
    sft_batch_size: int = Field(64, ge=1)
    sft_lr: float = Field(3e-3, gt=0)
    seed: int = 0


class RolloutConfig(_Strict):
    group_size: int = Field(8, ge=2, description="G completions per prompt")
    prompts_per_step: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8, ge=1)
    dynamic_sampling: bool = Field(False, description="DAPO: drop all-equal-reward groups and sample more prompts")
    max_sampling_rounds: int = Field(4, ge=1, description="rounds of refill for dynamic sampling")
    overlong_cache: int | None = Field(None, ge=1, description="DAPO overlong shaping: penalty zone length in tokens")
    # behaviour shifts (the off-policy lab); the learner always trains float32 at T = 1
    precision: Literal["float32", "bfloat16", "float16", "int8"] = Field(
        "float32", description="rollouts from a copy of the policy in this precision (int8: dynamic quantization)")
    staleness: int = Field(0, ge=0, description="rollouts from the policy as it was this many optimizer steps ago")
    foreign_fraction: float = Field(0.0, ge=0, lt=1, description="fraction of each group sampled by foreign_model")
    foreign_model: str | dict[str, Any] = Field(
        "initial", description="'initial' (the frozen starting policy), a local HF directory with the same "
                               "tokenizer, or model-config overrides for another default base (e.g. {hidden: 96, seed: 1})")


class ObjectiveConfig(_Strict):
    name: str = "p3o"
    options: dict[str, Any] = Field(default_factory=dict)
    advantage: Literal["zscore", "mean", "rloo"] = "zscore"
    std: Literal["population", "sample"] = "population"


class TrainConfig(_Strict):
    steps: int = Field(250, ge=1, description="rollout rounds; each gives epochs × minibatches optimizer steps")
    lr: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(10, ge=0, description="linear learning-rate warm-up, in optimizer steps")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(512, ge=1)
    minibatches: int = Field(1, ge=1, description="optimizer steps per epoch over one rollout batch")
    epochs: int = Field(1, ge=1, description="passes over one rollout batch (replay)")
    ess_scope: Literal["batch", "micro_batch", "sequence"] = "batch"
    seed: int = 0


class EvalConfig(_Strict):
    every: int = Field(50, ge=1, description="held-out evaluation every N rollout rounds")
    samples_per_prompt: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)


class Config(_Strict):
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run_dir: str | None = None
    checkpoint_every: int = Field(50, ge=1)
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = all cores")

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, v: ObjectiveConfig) -> ObjectiveConfig:
        from . import objectives

        objectives.get(v.name)  # raises ValueError listing the known names
        return v


def _set_dotted(d: dict, key: str, value: Any) -> None:
    if key == "data" and isinstance(value, str):  # data=FILE is short for data.train=FILE
        key = "data.train"
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise UserError(f"config key {key!r}: {p!r} is not a section")
        d = nxt
    d[parts[-1]] = value


def _format_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown config key {loc!r}; see `trustbatch train --help` or the README for the keys"
    msg = err["msg"].removeprefix("Value error, ")
    return f"invalid value for {loc!r}: {msg} (got {err.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Defaults ← ``base`` dict ← YAML file ← ``key=value`` overrides (values parsed as YAML).

    Raises:
        UserError: a missing or unreadable file, an override without ``=``, an unknown key,
            an invalid value. The message is one line and names the key.
    """
    data: dict = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise UserError(f"config file {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"config file {str(p)!r} must hold a mapping of sections")
        for k, v in _flatten(loaded).items():
            _set_dotted(data, k, v)
    for ov in overrides or []:
        if "=" not in ov:
            raise UserError(f"override {ov!r} must look like key=value, e.g. train.steps=50")
        k, _, v = ov.partition("=")
        try:
            val = yaml.safe_load(v) if v != "" else None
        except yaml.YAMLError:
            val = v
        _set_dotted(data, k.strip(), val)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise UserError(_format_error(e)) from None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        # Free-form dicts (task.params, objective.options) are set whole, not flattened.
        if isinstance(v, dict) and key not in ("task.params", "objective.options"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
