"""Loading a policy (a Hugging Face causal LM plus its tokenizer) from a local directory, or building one.

``Policy`` bundles the model and tokenizer with the ids the rollout engine and learner need. Any
local HF directory loads with ``from_pretrained``; no hub is contacted (``local_files_only``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError


@dataclass
class Policy:
    model: torch.nn.Module  # a transformers causal LM
    tokenizer: object  # a transformers tokenizer
    eos_id: int
    pad_id: int

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids, with the tokenizer's special prefix (e.g. BOS) and chat template if it has one."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def encode_completion(self, text: str) -> list[int]:
        """Completion ids followed by EOS (no prefix)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, path: Path) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> Policy:
    """Load an HF causal LM and tokenizer from a local directory.

    A tokenizer without a pad token pads with EOS (stories260K has none).

    Raises:
        UserError: the directory is missing or holds no loadable model or tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"model path {str(p)!r} does not exist; give a local Hugging Face model directory (model.path=DIR)")
    if not (p / "config.json").exists():
        raise UserError(f"{str(p)!r} has no config.json; it is not a Hugging Face model directory")
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the model in {str(p)!r}: {str(e).splitlines()[0]}") from None
    if tok.eos_token_id is None:
        raise UserError(f"the tokenizer in {str(p)!r} has no EOS token; completions could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.config.pad_token_id = tok.pad_token_id
    return Policy(model=model, tokenizer=tok, eos_id=int(tok.eos_token_id), pad_id=int(tok.pad_token_id))


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
