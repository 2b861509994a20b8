"""Rollout tokens/s of the engines side by side (transformers' decode loops, vLLM), and their ratios.

    .venv-vllm/bin/python bench/rollout_engines.py [--threads 2] [--repeats 3] [--models base,large]
    python bench/rollout_engines.py --engines transformers,static,static_compiled --models base --tokens 8

(``make test-vllm`` builds .venv-vllm.) Engines (``--engines``, the first is the reference of the ratios):
``transformers`` (``TransformersEngine``, decode="dynamic": ``generate``), ``static`` and ``static_compiled`` (its
``rollout.static_decode`` loop, eager and through ``torch.compile``), ``vllm``; ``+philox`` after a transformers
arm samples with ``noise="philox"``. Two random-initialised Llamas with the project's tokenizer:
``base``, the default base's shape (hidden 128, 4 layers, 4 heads: head_dim 32, ~0.9M parameters),
where per-step overhead dominates; ``large`` (hidden 768, 8 layers, 12 heads: head_dim 64,
~61M parameters), where kernel speed matters. Same prompts, samples per prompt, completion length,
threads and float32 for every engine; repeats are interleaved (transformers, vLLM, transformers, …)
so machine noise hits all alike, after one untimed warm-up each (``harness.interleave``; it compiles
``static_compiled``); the median is reported. tokens/s counts completion tokens (EOS included) over wall time of
``generate``. One JSON line per model and engine is appended to ``bench/results/rollout_engines.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from trustbatch.policy import load_policy
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.rollout import SamplingParams, TransformersEngine

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402

# name: (hidden, layers, heads, prompts, samples per prompt, completion tokens)
MODELS = {"base": (128, 4, 4, 64, 8, 64), "large": (768, 8, 12, 16, 8, 64)}


def build(path: Path, hidden: int, layers: int, heads: int) -> int:
    """Save a random Llama and tokenizer in ``path``; return its parameter count."""
    tok = train_tokenizer([f"Compute {a} + {b} = {a + b}" for a in range(40) for b in range(40)], vocab_size=384)
    model = build_small_llama(len(tok), hidden=hidden, layers=layers, heads=heads, max_len=256, seed=0, tokenizer=tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make(name: str, policy, path: Path, threads: int):
    """The engine arm ``name`` (module docstring) on ``policy`` (saved in ``path``)."""
    if name == "vllm":
        from trustbatch.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(path, policy.eos_id, policy.pad_id, threads=threads, seed=0)
    decode, _, noise = name.partition("+")
    decode = "dynamic" if decode == "transformers" else decode
    return TransformersEngine(policy.model, policy.eos_id, policy.pad_id, decode=decode, noise=noise or "generator")


def main() -> None:
    ap = options(argparse.ArgumentParser())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="base,large")
    ap.add_argument("--engines", default="transformers,vllm", help="arms, the first the ratios' reference")
    ap.add_argument("--tokens", type=int, default=None, help="completion tokens (default: the model's, below)")
    a = ap.parse_args()
    names = a.engines.split(",")
    # before any vLLM engine starts: afterwards torch.set_num_threads is vLLM's no-op
    torch.set_num_threads(a.threads)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            hidden, layers, heads, P, G, M = MODELS[name]
            M = a.tokens or M
            path = Path(tmp) / name
            params = build(path, hidden, layers, heads)
            policy = load_policy(path)
            g = torch.Generator().manual_seed(0)
            prompts = [[policy.tokenizer.bos_token_id] + torch.randint(3, len(policy.tokenizer), (24,), generator=g).tolist()
                       for _ in range(P)]
            sp = SamplingParams(temperature=1.0, max_new_tokens=M)
            engines = {k: make(k, policy, path, a.threads) for k in names}

            def rate(eng) -> float:
                t = time.perf_counter()
                ro = eng.generate(prompts, G, sp)
                return sum(len(x.completion_ids) for x in ro) / (time.perf_counter() - t)

            rates = interleave({k: (lambda eng=eng: rate(eng)) for k, eng in engines.items()}, a.repeats)
            results.update({f"{name}/{k}": {"tokens_per_s": v, "params": params, "prompts": P, "samples": G,
                                            "max_new_tokens": M} for k, v in rates.items()})
            med = {k: statistics.median(v) for k, v in rates.items()}
            rows.append((name, params, f"{P}x{G}x{M}", med))
            del engines
    print(f"\nthreads={a.threads}, repeats={a.repeats} (median), float32, temperature 1.0")
    print(f"{'model':<6} {'params':>8} {'prompts x n x tokens':>21} " + " ".join(f"{k + ' tok/s':>24}" for k in names)
          + " " + " ".join(f"{k + '/' + names[0]:>30}" for k in names[1:]))
    for name, params, shape, med in rows:
        print(f"{name:<6} {params / 1e6:>7.1f}M {shape:>21} " + " ".join(f"{med[k]:>24,.0f}" for k in names)
              + " " + " ".join(f"{med[k] / med[names[0]]:>29.2f}x" for k in names[1:]))
    record("rollout_engines", results, extra={"threads": a.threads, "dtype": "float32", "temperature": 1.0},
           save=not a.no_save)


if __name__ == "__main__":
    main()
