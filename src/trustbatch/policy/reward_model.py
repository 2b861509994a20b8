"""A reward model as a reward (``reward.model=DIR``): a local ``transformers`` sequence-classification model with one
label, whose logit is the reward.

What it scores is what TRL's ``GRPOTrainer`` scores for a reward model on plain-text prompts: the text
``prompt + completion`` (the data's prompt as written, not the policy's chat framing or ``data.max_prompt_tokens``
cut), tokenized by the reward model's own tokenizer with no special tokens added, right-padded,
``reward.model_batch_size`` texts per forward, not truncated; the reward is ``logits[:, 0]``, the single logit at
the last non-pad token (transformers' pooling for ``*ForSequenceClassification``). It is not clamped into [0, 1] as a
scorer's reward is: a learned score has no such range, and the group advantage only needs differences.

The model runs in the trainer's process on the learner's device, in float32 with no gradients, as one term of the
training reward's weighted sum (``rewards.functions.WeightedRewards``, term ``rm:DIR``, logged as
``rewards/reward_model``). A model is no function that reward worker or rollout worker processes could build from a
name at little cost, so it never goes there: ``recipes.checks.check_reward`` refuses ``rollout.mode=async`` and
``orchestrator=ray`` with it, as ``rewards.objects`` refuses Python objects there.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..chat import Conversation
from ..errors import UserError
from ..rewards.scorers import ScoreResult, one_line
from .hub import model_dir
from .model import load_checked, read_model_config

ARCHITECTURE = "ForSequenceClassification"  # the suffix of every transformers sequence-classification class


def check_reward_model(path: str | Path) -> Path:
    """The local directory of the reward model ``path`` (a Hub id's snapshot too), checked from its config alone, so
    that a wrong directory is refused before any model loads.

    Raises:
        UserError: one line: ``path`` is missing, has no valid config.json, is not a sequence-classification model
            (no ``*ForSequenceClassification`` in its ``architectures``: a causal LM would load with a random head),
            or has ``num_labels`` other than 1 (the reward is the single logit; a classifier's label would need
            choosing, which trustbatch does not do).
    """
    from transformers import AutoConfig

    p = model_dir(path, key="reward.model")
    where = repr(str(p))
    if not p.is_dir():
        raise UserError(f"reward.model {where} does not exist; give the directory of a sequence-classification reward "
                        "model (AutoModelForSequenceClassification, num_labels=1)")
    archs = read_model_config(p).get("architectures") or []
    if not any(str(a).endswith(ARCHITECTURE) for a in archs):
        raise UserError(f"reward.model {where} is {', '.join(map(str, archs)) or 'a model of no recorded architecture'}"
                        f", not a sequence-classification model (*{ARCHITECTURE}); give a reward model's directory")
    labels = AutoConfig.from_pretrained(p, local_files_only=True).num_labels
    if labels != 1:
        raise UserError(f"reward.model {where} has num_labels={labels}; the reward is a model's single logit, so give "
                        "a reward model with num_labels=1 (a classifier's label is not picked)")
    return p


def load_reward_model(path: str | Path, *, device: str | torch.device = "cpu", batch_size: int = 16) -> "RewardModel":
    """The reward model at ``path`` (``check_reward_model``), loaded and checked as a policy is
    (``policy.model.load_checked``: the weights fill the architecture, the score head included) in float32 on
    ``device``, with its tokenizer; a tokenizer without a pad token pads with EOS, and the model's
    ``pad_token_id`` becomes the tokenizer's (its pooling finds the last non-pad token by that id), as TRL does.

    Raises:
        UserError: what ``check_reward_model`` and ``load_checked`` refuse; a tokenizer with neither a pad nor an EOS
            token.
    """
    from transformers import AutoModelForSequenceClassification

    p = check_reward_model(path)
    model, tok = load_checked(p, AutoModelForSequenceClassification, torch.float32)
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UserError(f"the tokenizer of reward.model {str(p)!r} has neither a pad nor an EOS token to pad a "
                            "batch with; set its pad_token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    model.config.pad_token_id = tok.pad_token_id
    model.requires_grad_(False)
    return RewardModel(model.to(device).eval(), tok, name=str(p), batch_size=batch_size)


class RewardModel:
    """Scores ``prompt + completion`` texts with a sequence-classification model (module docstring); the interface of
    a ``rewards.RewardPool`` (``score``, ``close``, ``in_process_marker``), so ``WeightedRewards`` sums it as a term.

    A batch whose forward raises (e.g. out of memory) scores 0 for each of its texts and counts them as errors, as a
    failing scorer's completions are (``reward.max_failure_rate`` then stops the run in one line); so do an empty
    text and a non-finite logit.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, name: str, batch_size: int = 16):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.name, self.batch_size = model, tokenizer, name, batch_size
        self.in_process_marker = None  # a pool's attribute; the model is no user code that could exit the process

    def texts(self, completions: list[str], contexts: list[dict] | None) -> list[str]:
        """What is scored: each completion after its prompt (``contexts[i]["prompt"]``; none without contexts). A
        prompt given as chat messages (``chat.Conversation``) and the completion as the assistant's message, through
        the reward model's own chat template, as TRL's ``GRPOTrainer`` renders them for a reward model.

        Raises:
            UserError: a prompt given as chat messages, and a reward model whose tokenizer has no chat template.
        """
        out = []
        for i, c in enumerate(completions):
            prompt = contexts[i].get("prompt", "") if contexts else ""
            if not isinstance(prompt, Conversation):
                out.append(prompt + c)
                continue
            if not getattr(self.tokenizer, "chat_template", None):
                raise UserError(f"reward model {self.name!r} has no chat template, and the prompts are chat messages "
                                "(TRL's conversational format): a reward model scores such a conversation through its "
                                "own template; give a reward model with one, or the prompts as text")
            out.append(self.tokenizer.apply_chat_template(prompt.as_list() + [{"role": "assistant", "content": c}],
                                                          tokenize=False))
        return out

    def score(self, completions: list[str], references: list[str], *, contexts: list[dict] | None = None,
              max_failure_rate: float | None = None) -> ScoreResult:
        """The reward model's logit for each completion after its prompt, in order (``references`` are not read).

        Raises:
            ValueError: the lists differ in length (a caller's bug).
        """
        if len(completions) != len(references) or (contexts is not None and len(contexts) != len(completions)):
            raise ValueError(f"{len(completions)} completions but {len(references)} references"
                             + ("" if contexts is None else f" and {len(contexts)} contexts"))
        texts = self.texts(completions, contexts)
        res = ScoreResult([], 0, 0)
        for start in range(0, len(texts), self.batch_size):
            for v, cause in self._forward(texts[start:start + self.batch_size]):
                res.rewards.append(v)
                res.errors += cause is not None
                res.last_error = cause or res.last_error
        return res

    def _forward(self, texts: list[str]) -> list[tuple[float, str | None]]:
        """``(reward, cause of failure or None)`` per text of one batch."""
        device = next(self.model.parameters()).device
        try:
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.inference_mode():
                logits = self.model(**enc).logits[:, 0].float().cpu().tolist()
            lengths = enc["attention_mask"].sum(dim=1).tolist()
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - counted against reward.max_failure_rate, as a scorer's failure
            cause = one_line(f"reward model {self.name!r}: {type(e).__name__}: {e}")
            return [(0.0, cause)] * len(texts)
        out = []
        for v, n in zip(logits, lengths):
            if n == 0:
                out.append((0.0, "the reward model was given an empty prompt and completion"))
            elif not math.isfinite(v):
                out.append((0.0, f"reward model {self.name!r} returned {v}"))
            else:
                out.append((float(v), None))
        return out

    def close(self) -> None:
        """Drop the model (its memory goes with the last reference)."""
        self.model = None
