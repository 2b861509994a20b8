"""Rollouts with ``transformers`` ``generate`` on CPU (or any torch device)."""

from __future__ import annotations

import copy

import torch

from .engine import Rollout, SamplingParams
from .shifts import behaviour_copy


class TransformersEngine:
    """Samples with ``model.generate`` and records behaviour log-probs from the processed scores.

    ``generate`` returns, per step, the scores after temperature and top-p; their log-softmax at
    the sampled token is exactly the log-prob under the sampling distribution.

    With ``share=True`` (the default in float32) the engine samples from ``model`` itself and
    ``load_weights`` with no tensors only moves the version; otherwise it keeps its own copy in
    ``precision`` (see ``rollout.shifts``) and loads the learner's named weights into it, cast to
    that precision (int8: re-quantized from a float copy).
    """

    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, *, batch_size: int = 512,
                 precision: str = "float32", share: bool | None = None, version: int = 0):
        self.precision = precision
        share = precision == "float32" if share is None else share
        if share and precision != "float32":
            raise ValueError(f"a {precision} engine cannot share the float32 module; pass share=False")
        self.shared = share
        self.model = model if share else behaviour_copy(model, precision)
        # quantized modules cannot load float weights, so an int8 engine re-quantizes a float copy
        self._float_model = copy.deepcopy(model) if precision == "int8" else None
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.batch_size = batch_size
        self.version = version

    def load_weights(self, weights, version: int) -> None:
        """Load named float tensors (the full state) as policy ``version``; see ``Engine.load_weights``.

        Raises:
            ValueError: no tensors for an engine with its own copy; missing or unexpected names
                (``load_state_dict`` strict).
        """
        state = dict(weights)
        if not state:
            if not self.shared:
                raise ValueError("load_weights got no tensors, but this engine holds its own copy of the "
                                 "policy; send the full named state")
        elif self._float_model is not None:
            self._float_model.load_state_dict(state)
            self.model = behaviour_copy(self._float_model, "int8")
        else:
            self.model.load_state_dict(state)  # copy_ casts to bf16/fp16
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Rollout]:
        """``n`` completions per prompt, grouped; see ``Engine.generate``."""
        flat = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        out: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for s in range(0, len(flat), self.batch_size):
                out.extend(self._generate_chunk(flat[s:s + self.batch_size], sampling))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, items, sp: SamplingParams):
        P = max(len(p) for _, p in items)
        ids = torch.full((len(items), P), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for j, (_, p) in enumerate(items):
            ids[j, P - len(p):] = torch.tensor(p)
            att[j, P - len(p):] = 1
        kwargs = (dict(do_sample=False) if sp.greedy
                  else dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=0))
        gen = self.model.generate(
            input_ids=ids, attention_mask=att, max_new_tokens=sp.max_new_tokens,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            output_scores=True, return_dict_in_generate=True, **kwargs,
        )
        new = gen.sequences[:, P:]
        scores = torch.stack(gen.scores, dim=1).float()  # [N, steps, V], processed (T, top-p)
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        rows = []
        for j, (i, p) in enumerate(items):
            toks = new[j].tolist()
            end = toks.index(self.eos_id) + 1 if self.eos_id in toks else len(toks)
            rows.append(Rollout(
                prompt_index=i, prompt_ids=list(p), completion_ids=toks[:end],
                behavior_logprobs=logp[j, :end].tolist(), truncated=self.eos_id not in toks,
                policy_version=self.version,
            ))
        return rows
