"""The run configuration: ``Config`` (every section), ``load_config`` (defaults ← base ← YAML ← ``key=value``) and
the helpers that walk its keys."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from ..errors import UserError
from .sections import (DataConfig, EvalConfig, Int, LogConfig, ModelConfig, ObjectiveConfig, RewardConfig,
                       RolloutConfig, TaskConfig, TrainConfig, _Strict, set_unread)
from .yaml_io import read_yaml_file, yaml_dumps, yaml_loads


class Config(_Strict):
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    run_dir: str | None = Field(None, description="the run directory (default: a new folder "
                                                  "runs/DATE-TIME-OBJECTIVE, -2, -3, ... added when another run "
                                                  "started in the same second took the name)")
    checkpoint_every: Int = Field(50, ge=1, description="rounds between checkpoints (a step-0 checkpoint follows the "
                                                        "base evaluation)")
    checkpoint_keep: Int = Field(2, ge=1, description="newest checkpoints kept (older ones are deleted after each "
                                                  "save; the run resumes from the newest)")
    checkpoint_keep_best: bool = Field(
        False, description="also keep the checkpoint of the highest held-out accuracy (heldout_accuracy in "
                           "metrics.jsonl, the earliest on ties) of the rounds both evaluated and checkpointed, "
                           "never rotated out; checkpoints/best links to it (trustbatch export RUN --step best)")
    orchestrator: Literal["local", "ray"] = Field(
        "local", description="local: rollout workers are processes of this machine; ray: Ray actors on a local or "
                             "existing cluster (with rollout.mode=async; needs trustbatch[ray])")
    ray_address: str | None = Field(None, description="orchestrator=ray: the cluster to join (host:6379); "
                                                      "default RAY_ADDRESS, else a new local cluster")
    ray_learners: Int = Field(1, ge=0, description="orchestrator=ray: learner ranks, each a Ray actor (data parallel, "
                                                   "gloo on CPU); 0 trains in the driver's process")
    threads: Int = Field(0, ge=0, description="torch CPU threads; 0 = all cores")

    @model_validator(mode="after")
    def _task_keys_without_a_data_file(self) -> "Config":
        # a data file is the task: the reasoning-gym task's keys would be read by nothing (the run said it trained
        # 256 held-out prompts where task.heldout_size=64 asked for fewer)
        if self.data.train:
            default = TaskConfig().model_dump()
            unread = next((k for k, v in self.task.model_dump().items() if v != default[k]), None)
            if unread is not None:
                fix = f"use data.{unread}" if unread in ("train_size", "heldout_size") else f"drop task.{unread}"
                raise ValueError(f"task.{unread} is read only without data.train (the data file is the task); {fix}")
        return self

    @model_validator(mode="after")
    def _ray_keys_need_ray(self) -> "Config":
        for key in ("ray_address", "ray_learners"):  # the local orchestrator reads neither
            if self.orchestrator == "local" and set_unread(self, key):
                raise ValueError(f"{key}={getattr(self, key)} is read only with orchestrator=ray; set it too (with "
                                 f"rollout.mode=async), or drop {key}")
        return self

    @model_validator(mode="after")
    def _minibatches_have_rows(self) -> "Config":
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        if self.train.minibatches > rows:
            raise ValueError(f"train.minibatches={self.train.minibatches} splits a round of {rows} completions "
                             f"(rollout.prompts_per_step × group_size) into more optimizer steps than it has rows; "
                             f"set train.minibatches ≤ {rows}")
        return self

    @model_validator(mode="after")
    def _task_defaults(self) -> "Config":
        # a task whose completions need more room (data.tasks.TASK_DEFAULTS) gets it unless the key was set
        from ..data.tasks import TASK_DEFAULTS

        for key, value in ({} if self.data.train else TASK_DEFAULTS.get(self.task.name, {})).items():
            section, name = key.split(".")
            sub = getattr(self, section)
            if name not in sub.model_fields_set:
                object.__setattr__(sub, name, value)  # validate_assignment would re-run this validator
        return self


def _set_dotted(d: dict, key: str, value: Any) -> None:
    if key == "data" and isinstance(value, str):  # data=FILE is short for data.train=FILE
        key = "data.train"
    parts = key.split(".")
    for p in parts[:-1]:
        if d.get(p) is None:  # a section left null (model.lora: null in a printed config) is set from its defaults
            d[p] = {}
        nxt = d[p]
        if not isinstance(nxt, dict):
            raise UserError(f"config key {key!r}: {p!r} is not a section")
        d = nxt
    d[parts[-1]] = value


def config_fields(model: type[BaseModel] | None = None, prefix: str = ""):
    """Yield ``(dotted key, field, sections)`` for every field of ``Config`` (default) and its sections, depth first.

    ``sections`` are the pydantic models the field's annotation holds (``[LoraConfig]`` for ``model.lora``, empty for
    a plain value); their fields follow the section's own entry, prefixed ``key.``.
    """
    for name, field in (model or Config).model_fields.items():
        subs = _models_in(field.annotation)
        yield prefix + name, field, subs
        for sub in subs:
            yield from config_fields(sub, f"{prefix}{name}.")


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in getattr(annotation, "__args__", ()) for m in _models_in(a)]  # a union, list[...], Literal


# TRL's GRPOConfig arguments a TRL user writes as a key, and what sets the same here (max_prompt_length: TRL < 1.0's)
TRL_NAMES = {
    "num_generations": "rollout.group_size", "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens", "learning_rate": "train.lr", "max_steps": "train.steps",
    "num_iterations": "train.epochs", "steps_per_generation": "train.minibatches",
    "per_device_train_batch_size": "rollout.prompts_per_step x rollout.group_size (the completions of a round; "
                                   "train.micro_batch_size of them per forward)",
    "gradient_accumulation_steps": "train.micro_batch_size (the micro-batches of a step are accumulated)",
    "temperature": "rollout.temperature with objective.temperature=rollout (the learner's logits divided by it too, "
                   "as TRL's; by default the learner scores at 1, and a batch sampled at another temperature is "
                   "off-policy data)",
    "top_p": "rollout.top_p", "beta": "objective.options={ref_kl_coef: ...}",
    "epsilon": "objective.options={eps_low: ..., eps_high: ...}", "epsilon_high": "objective.options={eps_high: ...}",
    "loss_type": "objective.name=grpo with objective.options={aggregation: ...}: TRL's dapo (its default, both clips at "
                 "epsilon) is token_mean, its grpo seq_mean_token_mean, its dr_grpo seq_mean_token_sum (divided by "
                 "rollout.max_new_tokens); objective.name=dapo clips above at 0.28",
    "scale_rewards": "objective.advantage=zscore with objective.std=sample for TRL's group (its default; σ + 1e-4 "
                     "there, + 1e-6 here), objective.advantage=mean for none; batch has no equivalent",
    "importance_sampling_level": "objective.name=gspo for sequence (token: the other objectives)",
    "delta": "objective.options={dual_clip: ...} (the same bound on the ratio of a negative advantage's tokens, "
             "where delta > 1 + epsilon_high)",
    "num_generations_eval": "eval.samples_per_prompt", "num_train_epochs": "train.steps (rounds: an epoch over the "
                                                                          "data is its rows / rollout.prompts_per_step)",
    "shuffle_dataset": "rollout.prompt_order (epochs: shuffled anew each epoch)", "log_completions": "log.samples",
    "warmup_steps": "train.warmup_steps", "lr_scheduler_type": "train.lr_schedule",
    "weight_decay": "train.weight_decay", "max_grad_norm": "train.grad_clip",
    "adam_beta1": "train.adam_betas=[b1, b2]", "adam_beta2": "train.adam_betas=[b1, b2]",
    "adam_epsilon": "train.adam_eps", "seed": "train.seed", "gradient_checkpointing": "train.activation_checkpointing",
    "bf16": "train.precision=bf16-mixed", "output_dir": "run_dir", "report_to": "log.trackers",
    "save_steps": "checkpoint_every", "save_total_limit": "checkpoint_keep", "eval_steps": "eval.every",
    "use_vllm": "rollout.engine=vllm", "reward_weights": "reward.functions=[{name: ..., weight: ...}]",
}


# TRL's GRPOConfig arguments that have no equivalent here, and why
TRL_UNSUPPORTED = {
    "top_k": "sampling takes rollout.temperature and rollout.top_p alone",
    "min_p": "sampling takes rollout.temperature and rollout.top_p alone",
    "repetition_penalty": "sampling takes rollout.temperature and rollout.top_p alone",
    "generation_kwargs": "sampling takes rollout.temperature, rollout.top_p and rollout.max_new_tokens alone",
    "mask_truncated_completions": "a completion cut at rollout.max_new_tokens trains as it is; rollout.overlong_cache "
                                  "shapes the reward of long ones instead (DAPO's overlong penalty)",
}


def trl_hint(name: str) -> str | None:
    """What to write here for TRL's GRPOConfig argument ``name`` (``TRL_NAMES``, ``TRL_UNSUPPORTED``), as a clause
    for a refusal, or None for another name."""
    if name in TRL_NAMES:
        return f"TRL's {name} is {TRL_NAMES[name]} here"
    if name in TRL_UNSUPPORTED:
        return f"TRL's {name} has no equivalent here: {TRL_UNSUPPORTED[name]}"
    return None


def nearest_key(key: str) -> str | None:
    """The known config key a mistyped ``key`` most likely meant (difflib), or None.

    First a close name in the same section (``train.step`` -> ``train.steps``, ``trian`` -> ``train``), else the one
    key of that name in another section (``rollout.lr`` -> ``train.lr``).
    """
    section, _, name = key.rpartition(".")
    keys = [k for k, _, _ in config_fields()]
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    near = difflib.get_close_matches(name, siblings, n=1)
    if near:
        return f"{section}.{near[0]}" if section else near[0]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == name]
    return elsewhere[0] if len(elsewhere) == 1 else None


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _format_error(e: ValidationError) -> str:
    errs = e.errors()
    # A union (e.g. rollout.foreign_model: str | dict) reports one error per branch: prefer the one
    # about the value over "should be a valid string", and drop the branch tags from the key.
    err = next((x for x in errs if not x["type"].endswith("_type")), errs[0])
    parts = [str(x) for x in err["loc"]]
    while len(parts) > 1 and (parts[-1] in _UNION_TAGS or "[" in parts[-1]):
        parts.pop()
    loc = ".".join(parts)
    if err["type"] == "extra_forbidden":
        near = nearest_key(loc)
        name = loc.rpartition(".")[2]
        trl = trl_hint(name)
        hint = f"{trl}; " if trl else f"did you mean {near!r}? " if near else ""
        return f"unknown config key {loc!r}; {hint}every key: docs/config.md (or `trustbatch train --print-config`)"
    msg = err["msg"].removeprefix("Value error, ")
    # a section's own check names its key itself, and a check across sections (no loc) names its keys
    if err["type"] == "value_error" and (not loc or msg.startswith(f"{loc}.")):
        return msg
    if err["type"].endswith("_type"):  # every branch refused the type: name them all
        msg = " or ".join(dict.fromkeys(x["msg"] for x in errs if x["type"].endswith("_type")))
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"invalid value for {loc!r}: {msg} (got {got}){_shape_hint(err['type'], loc)}"


def _shape_hint(kind: str, loc: str) -> str:
    """How to write the list or mapping that a value of the wrong shape should have been, as an override.

    ``log.trackers=wandb`` -> ``log.trackers=[a, b]``; ``model.lora=true`` -> ``model.lora={r: ...}`` (``{}``: the
    defaults); ``reward.functions=[gsm8k]`` (item 0) -> ``reward.functions=[{name: ..., weight: ...}]``.
    """
    if kind in ("list_type", "tuple_type"):
        return f"; write a YAML list: '{loc}=[a, b]'"
    if kind == "string_type":  # YAML read text as another type (`Answer: briefly` a mapping, `12:30` a number)
        return f"; quote a text value for YAML: \"{loc}='...'\""
    if kind not in ("dict_type", "model_type"):
        return ""
    section = ".".join(p for p in loc.split(".") if not p.isdigit())
    fields = [(k.rpartition(".")[2], f) for k, f, _ in config_fields() if k.rpartition(".")[0] == section]
    if not fields:  # a free-form mapping (task.params, objective.options)
        return f"; write a YAML mapping: '{loc}={{name: value}}'"
    mapping = "{" + ", ".join(f"{name}: ..." for name, _ in fields) + "}"
    if section != loc:  # an item of a list of sections
        return f"; write a YAML list of mappings: '{section}=[{mapping}]'"
    defaults = "" if any(f.is_required() for _, f in fields) else f", or '{section}={{}}' for the defaults"
    return f"; write a YAML mapping: '{section}={mapping}'{defaults}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Defaults ← ``base`` dict ← YAML file ← ``key=value`` overrides (values parsed as YAML).

    Values are parsed by ``yaml_loads`` (``3e-1`` is a float). Numbers must be finite and not
    booleans (``train.steps=true`` is refused), also inside ``objective.options`` and ``task.params``. YAML's
    boolean words (``on``, ``off``, ``yes``, ``no``, ``true``, ``false``) are booleans for a boolean key and inside
    free-form dicts, and the word as typed for any other key (``data.chat_template=on``), so refusals quote it.

    Raises:
        UserError: a missing, non-UTF-8 or invalid YAML file, an override without ``=``, an unknown
            key, an invalid value. The message is one line and names the key.
    """
    data: dict = copy.deepcopy(base or {})  # overrides set keys in nested dicts: never in the caller's
    if path is not None:
        loaded = read_yaml_file(path, words=True) or {}
        if not isinstance(loaded, dict):
            raise UserError(f"config file {str(path)!r} must hold a mapping of sections")
        for k, v in _flatten(loaded).items():
            _set_dotted(data, k, v)
    for ov in overrides or []:
        if "=" not in ov:
            raise UserError(f"override {ov!r} must look like key=value, e.g. train.steps=50")
        k, _, v = ov.partition("=")
        _set_dotted(data, k.strip(), _override_value(v))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise UserError(_format_error(e)) from None


_HASH = "\ue000"  # a private-use character: a '#' of the value stands in for it while YAML reads the value


def _override_value(text: str):
    """An override's value as YAML reads it (``[1, 2]``, ``{kl: exact}``, ``1e-3``), the whole text kept: YAML would
    read `` #`` on as a comment, and a command-line value holds none (``data.system_prompt=End with #### N`` lost its
    end). Text that is no YAML stays as typed; an empty value is null."""
    if text == "":
        return None
    try:
        value = yaml_loads(text.replace("#", _HASH), words=True)
    except yaml.YAMLError:
        return text
    return _restore_hash(value)


def _restore_hash(value):
    if isinstance(value, str) and _HASH in value:
        return value.replace(_HASH, "#")
    if isinstance(value, list):
        return [_restore_hash(v) for v in value]
    if isinstance(value, dict):
        return {_restore_hash(k): _restore_hash(v) for k, v in value.items()}
    return value


# keys whose value is one whole dict (or, for rollout.foreign_model, a name or a dict), never a section's keys
FREE_FORM = ("task.params", "objective.options", "rollout.foreign_model")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        # Free-form dicts (FREE_FORM) are set whole, not flattened; so is an empty one, which
        # sets a section to its defaults (``lora: {}``), as ``model.lora={}`` does on the command line.
        if isinstance(v, dict) and v and key not in FREE_FORM:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump_config(cfg: Config) -> str:
    return yaml_dumps(cfg.model_dump(mode="json"), sort_keys=False)
