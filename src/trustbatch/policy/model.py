"""Loading a policy (a Hugging Face causal LM plus its tokenizer) from a local directory, or building one.

``Policy`` bundles the model and tokenizer with the ids the rollout engine and learner need. Any
local HF directory loads with ``from_pretrained`` (``local_files_only``); a Hub id is first resolved to its
snapshot in the hub cache (``policy.hub``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..chat import Conversation
from ..data.benchmarks import truncate_left
from ..errors import UserError
from ..rewards.scorers import one_line
from .hub import model_dir


class _NoSequenceLengthWarning(logging.Filter):
    """Drops transformers' "Token indices sequence length is longer than the specified maximum" warning: prompts that
    do not fit the model's context are dropped with trustbatch's own one-line warning (``data.benchmarks.fit_prompts``), and the
    tokenizer's ``model_max_length`` is often not the model's context at all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer")


logging.getLogger("transformers.tokenization_utils_base").addFilter(_NoSequenceLengthWarning())


@dataclass
class Policy:
    model: torch.nn.Module  # a transformers causal LM
    tokenizer: object  # a transformers tokenizer
    eos_id: int
    pad_id: int
    # the peft.PeftModel wrapping ``model`` when LoRA adapters train (policy.lora.apply_lora), else None
    adapter: object | None = None
    chat_template: bool | None = None  # prompts through the tokenizer's chat template; None: when it has one
    text_as_is: bool = False  # a text prompt goes as it is, the template framing chat messages alone (TRL's rule)
    format_keys: tuple[str, str] = ("data.chat_template", "data.system_prompt")  # what set them, for messages
    system_prompt: str | None = None  # the system message before each prompt (chat template only)
    max_prompt_tokens: int | None = None  # encode_prompt keeps a prompt's last this many tokens (data.long_prompts)
    # the model's other end tokens (its generation_config's eos_token_id list): an Instruct model's end of turn
    # beside the tokenizer's EOS, e.g. <|im_end|> and <|endoftext|>
    more_end_ids: tuple[int, ...] = ()

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every token that ends a completion: the tokenizer's EOS first, then the model's other end tokens."""
        return (self.eos_id, *(i for i in self.more_end_ids if i != self.eos_id))

    def set_prompt_format(self, chat_template: str = "auto", system_prompt: str | None = None,
                          keys: tuple[str, str] = ("data.chat_template", "data.system_prompt")) -> None:
        """How ``encode_prompt`` frames a prompt: ``chat_template`` auto (the tokenizer's template when it has
        one), on, off, or messages (TRL's rule: a prompt given as chat messages through the template, a text prompt
        as it is); ``system_prompt`` a system message before each prompt. ``keys`` name the two settings in the
        messages (config keys or CLI options).

        Raises:
            UserError: ``on`` for a tokenizer without a chat template; a system prompt without one (or with off), with
                messages (text prompts would go without it), or one the template refuses (Gemma's and Mistral's
                raise "System role not supported").
        """
        has = bool(getattr(self.tokenizer, "chat_template", None))
        if chat_template not in ("auto", "on", "off", "messages"):
            raise UserError(f"{keys[0]}={chat_template!r} must be auto, on, off or messages")
        if chat_template == "on" and not has:
            raise UserError(f"{keys[0]}=on but the model's tokenizer has no chat template (no chat_template in its "
                            "tokenizer_config.json); use auto or off, or a chat model")
        if system_prompt and chat_template == "messages":
            raise UserError(f"{keys[1]} with {keys[0]}=messages: text prompts go as they are (TRL's rule), without a "
                            f"system message; put it into the rows' messages, or use {keys[0]}=auto")
        use = has if chat_template in ("auto", "messages") else chat_template == "on"
        if system_prompt and not use:
            raise UserError(f"{keys[1]} is sent as a system message through the chat template, and "
                            + ("the model's tokenizer has none" if not has else f"{keys[0]}=off")
                            + f"; drop {keys[1]} or put the instruction into the prompts")
        self.chat_template, self.system_prompt = use, system_prompt or None
        self.text_as_is = chat_template == "messages"
        self.format_keys = keys
        if self.system_prompt:  # the template's own refusal, now, as one line: not a traceback at the first prompt
            try:
                self._encode_whole_prompt("")
            except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception in the template)
                self.system_prompt = None
                raise UserError(f"the model's chat template refuses a system message ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else 'no message'}); drop {keys[1]} or put "
                                "the instruction into the prompts") from None

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids: through the tokenizer's chat template (``set_prompt_format``; by default when it has one) as
        ``[system?, user]`` messages with the assistant's generation prompt, else the text with the tokenizer's
        special prefix (e.g. BOS); with ``max_prompt_tokens``, the last that many of those ids
        (``data.benchmarks.truncate_left``). A ``chat.Conversation`` (TRL's conversational rows) is its own messages
        through the chat template, after ``system_prompt`` unless it has a system message of its own, as TRL's
        ``apply_chat_template`` renders it (``add_generation_prompt=True``); with ``data.chat_template=messages`` a
        text prompt is the text with the tokenizer's special prefix, as TRL tokenizes a standard-format prompt.

        Raises:
            UserError: a ``Conversation`` while prompts are not framed by a chat template (none in the tokenizer, or
                ``data.chat_template=off``).
        """
        return truncate_left(self._encode_whole_prompt(text), self.max_prompt_tokens)

    @property
    def uses_chat_template(self) -> bool:
        """Whether ``encode_prompt`` frames a text prompt with the tokenizer's chat template (``set_prompt_format``)."""
        return not self.text_as_is and self.frames_messages

    @property
    def frames_messages(self) -> bool:
        """Whether ``encode_prompt`` renders a prompt given as chat messages through the chat template."""
        return self.chat_template if self.chat_template is not None else \
            bool(getattr(self.tokenizer, "chat_template", None))

    def frames(self, prompt: str) -> bool:
        """Whether ``encode_prompt`` renders ``prompt`` through the chat template: a ``chat.Conversation`` wherever
        the template frames chat messages, a text prompt where ``uses_chat_template``."""
        return self.frames_messages if isinstance(prompt, Conversation) else self.uses_chat_template

    def _encode_whole_prompt(self, text: str) -> list[int]:
        tok = self.tokenizer
        messages = isinstance(text, Conversation)
        chat = text.as_list() if messages else [{"role": "user", "content": text}]
        if messages and not self.frames_messages:
            key = self.format_keys[0]
            why = (f"{key}=off turns it off; use {key}=auto or messages"
                   if getattr(tok, "chat_template", None) else "this model's tokenizer has none; use a chat model")
            raise UserError("a prompt given as chat messages (TRL's conversational format) needs the tokenizer's chat "
                            f"template, and {why}, or give the prompt as text")
        if self.frames(text):
            own = any(m["role"] == "system" for m in chat)
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt and not own else []
            try:  # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
                return list(tok.apply_chat_template(system + chat, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
            except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception in the template)
                if not messages:
                    raise
                raise UserError(f"the model's chat template refuses a prompt's messages ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else 'no message'}), roles "
                                f"{[m['role'] for m in system + chat]}: {one_line(text, 80)!r}; give messages the "
                                "template takes (e.g. no system message, or user and assistant in turn)") from None
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def encode_completion(self, text: str) -> list[int]:
        """Completion ids followed by EOS (no prefix)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, path: Path, state_dict: dict | None = None) -> None:
        """A Hugging Face model directory of the policy: its own weights, or ``state_dict``'s (e.g. gathered from
        FSDP2 shards); with LoRA adapters, the base with them merged (``policy.lora.merged_copy``), loadable with
        no peft (a checkpoint stores the adapter instead). transformers' "Writing model shards" progress bar is kept
        off stderr (``_quiet_transformers``): every save, a base's, ``sft --out``'s, a rollout worker's copy."""
        with _quiet_transformers():
            if self.adapter is not None:
                from .lora import merged_copy

                merged_copy(self.model).save_pretrained(path)
            else:
                self.model.save_pretrained(path, state_dict=state_dict)
            self.tokenizer.save_pretrained(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, revision: str | None = None,
                key: str = "model.path") -> Policy:
    """Load an HF causal LM and tokenizer from a local directory, or a Hub id's snapshot (``hub.model_dir``, at
    ``revision``). ``key`` is the setting that named ``path`` (``--model`` for ``trustbatch eval``), for the messages.

    A tokenizer without a pad token pads with EOS (stories260K has none). Loading is checked, so
    that a broken directory never yields a silently different model: every tensor the config
    asks for must be in the weights with its shape, no weight may be left over, every weight
    must be finite, and the tokenizer's ids must fit the embedding. A LoRA checkpoint directory
    (``adapter_config.json``, no ``config.json``) loads as its base with the adapter merged
    (``policy.lora.load_merged``).

    Raises:
        UserError: one line naming the directory and the cause: it is missing or not a model
            directory, its tokenizer is missing or unreadable, its weights are missing, truncated
            or corrupt, or config.json does not match the weights or the tokenizer.
    """
    from transformers import AutoModelForCausalLM

    p = model_dir(path, revision, key)
    where = repr(str(p))
    if not p.is_dir():
        what = "is a file, not a directory" if p.exists() else "does not exist"
        raise UserError(f"model path {where} {what}; give a local Hugging Face model directory ({key}=DIR)")
    if not (p / "config.json").exists() and (p / "adapter_config.json").exists():
        from .lora import load_merged  # a LoRA checkpoint: its base with the adapter merged

        return load_merged(p, load_policy, dtype=dtype)
    read_model_config(p)
    model, tok = load_checked(p, AutoModelForCausalLM, dtype)
    if tok.eos_token_id is None:
        raise UserError(f"the tokenizer in {where} has no EOS token; completions could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.config.pad_token_id = tok.pad_token_id
    return Policy(model=model, tokenizer=tok, eos_id=int(tok.eos_token_id), pad_id=int(tok.pad_token_id),
                  more_end_ids=generation_end_ids(model))


def generation_end_ids(model) -> tuple[int, ...]:
    """The end tokens the model's ``generation_config`` names (``eos_token_id``: one id, a list, or none)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return tuple(dict.fromkeys(int(i) for i in ids))


def read_model_config(p: Path) -> dict:
    """The parsed ``config.json`` of the model directory ``p``.

    Raises:
        UserError: ``p`` has no config.json (a trustbatch run directory: the message names its newest checkpoint),
            or one that is not JSON or names no ``model_type``.
    """
    where = repr(str(p))
    if not (p / "config.json").exists():
        # a trustbatch run directory: its models are its complete checkpoints (trainer/checkpoint.py, a floor above)
        steps = sorted(s for s in (p / "checkpoints").glob("step_*") if (s / "trainer_state.pt").exists())
        if steps and (p / "config.yaml").exists():
            raise UserError(f"{where} is a trustbatch run directory, not a model directory; give one of its "
                            f"checkpoints (the newest: {str(steps[-1])!r}) or export one (trustbatch export "
                            f"{str(p)} --out DIR)")
        raise UserError(f"{where} has no config.json; it is not a Hugging Face model directory")
    try:
        config = json.loads((p / "config.json").read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"model directory {where}: config.json is not valid JSON ({_cause(e)}); copy it again") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"model directory {where}: config.json names no model_type; it is not a Hugging Face model's config")
    return config


def load_checked(p: Path, auto_class, dtype: torch.dtype):
    """``(model, tokenizer)`` of the model directory ``p`` through transformers' ``auto_class`` (e.g.
    ``AutoModelForCausalLM``), quietly, then checked (``_check_loaded``): the weights fill the model config.json
    describes, all finite, and the tokenizer's ids fit its embedding.

    Raises:
        UserError: one line naming ``p``: no tokenizer files, a tokenizer or model that does not load, weights that
            do not match config.json or are not finite, a tokenizer bigger than the embedding.
    """
    from transformers import AutoTokenizer

    where = repr(str(p))
    if not any((p / f).exists() for f in TOKENIZER_FILES):
        raise UserError(f"model directory {where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                        "copy the model's tokenizer files into it")
    # trust_remote_code=False: never run a directory's own Python, and never ask (transformers' [y/N] prompt waits
    # for a terminal's answer); a model that needs it is refused in one line
    custom = (f"model directory {where} needs its own Python code (config.json's auto_map; trust_remote_code), "
              "which trustbatch does not run: use a model whose architecture transformers has built in")
    with _quiet_transformers():
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - any failure here is a bad directory, said in one line
            if "trust_remote_code" in str(e):
                raise UserError(custom) from None
            raise UserError(f"cannot load the tokenizer in {where}: {_cause(e)}; copy the model's tokenizer "
                            "files again") from None
        try:
            model, info = auto_class.from_pretrained(
                p, local_files_only=True, dtype=dtype, output_loading_info=True, trust_remote_code=False,
                ignore_mismatched_sizes=True)  # reported below with the tensor's name, not as a bare RuntimeError
        except Exception as e:  # noqa: BLE001
            if "trust_remote_code" in str(e):
                raise UserError(custom) from None
            raise UserError(f"cannot load the model in {where}: {_cause(e)}; check that config.json and the weights "
                            "are complete (copy the directory again)") from None
    _check_loaded(where, model, info, tok)
    return model, tok


def _cause(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0].rstrip('.') if lines else 'no message'}"


class _quiet_transformers:
    """Silence transformers' load report and progress bars (many lines) while loading or saving (its "Writing model
    shards" bar); restored after. Whatever a load would say, ``_check_loaded`` says in one line."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._log, self._verbosity = hf_logging, hf_logging.get_verbosity()
        self._bar = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        self._log.set_verbosity(self._verbosity)
        if self._bar:
            self._log.enable_progress_bar()


# buffers older transformers saved with the weights (attention masks, rotary frequencies): recomputed on load, no
# weight of the model, and transformers 5 loads such a checkpoint (EleutherAI/gpt-neo-125M, GPT-2 fine-tunes) with
# them reported as unexpected
_OLD_BUFFERS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def _check_loaded(where: str, model: torch.nn.Module, info: dict, tok) -> None:
    """UserError if the weights do not fill the model config.json describes, or the tokenizer does not fit it."""
    fix = "; config.json and the weights belong to different models: fix config.json or copy the matching weights"
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda m: m[0])
    if mismatched:
        key, in_file, in_config = mismatched[0]
        raise UserError(f"model directory {where}: {len(mismatched)} weights have other shapes than "
                        f"config.json gives, e.g. {key} is {list(in_file)} in the weights but {list(in_config)} by "
                        f"config.json{fix}")
    for kind, says in (("missing_keys", "lack {n} tensors config.json asks for"),
                       ("unexpected_keys", "hold {n} tensors config.json has no place for")):
        keys = sorted(k for k in info.get(kind) or [] if not (kind == "unexpected_keys" and k.endswith(_OLD_BUFFERS)))
        if keys:
            raise UserError(f"model directory {where}: the weights {says.format(n=len(keys))}, e.g. {keys[0]}{fix}")
    for name, t in model.named_parameters():
        if not torch.isfinite(t).all():
            raise UserError(f"model directory {where}: weight {name} holds NaN or infinite values; the weights are "
                            "corrupt, copy them again")
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise UserError(f"model directory {where}: the tokenizer has {len(tok)} tokens but the model's embedding only "
                        f"{rows} rows; the tokenizer belongs to another model, copy the matching one")


def build_small_llama(vocab_size: int, *, hidden: int, layers: int, heads: int, max_len: int, seed: int, tokenizer) -> torch.nn.Module:
    """A randomly initialised Llama causal LM (tied embeddings) sized for a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training forward is random: a dropout module with p > 0 (LoRA's ``lora_dropout``, GPT-2's
    residual dropout) or an attention dropout rate in its config (Llama and Qwen2 apply it functionally)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    return float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward: transformers' own checkpointing, non-reentrant.

    Only the layer inputs are kept from the forward (about ``layers × tokens × hidden`` floats instead of every
    intermediate); each layer is run again in backward. The gradients are those without it, up to float
    summation order. Uses ``activation_checkpointing_enable`` (transformers ≥ 5) or
    ``gradient_checkpointing_enable`` (older), with ``use_reentrant=False`` as torch recommends.

    Raises:
        ValueError: the model does not support activation checkpointing (transformers' own message, one line).
    """
    m = getattr(model, "module", model)  # inside a DDP-style wrapper
    kwargs = {"use_reentrant": False}
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(m, "gradient_checkpointing_enable"):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"{type(m).__name__} is not a transformers model; activation checkpointing needs one")
