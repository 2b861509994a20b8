"""How tight the exact KL's top-k lower bound is: the bound against the exact KL(π_θ‖π_b) on a trained model's
next-token distributions, by sampling temperature and k.

    python bench/top_k_kl_bound.py [--ks 1,5,20,50] [--temperatures 0.6,1.0,1.5] [--shift 0.01]

π_b: stories260K (V = 512; shared/models/stories260K-hf, or TRUSTBATCH_SHARED) teacher-forced over a few
TinyStories-style sentences (``TEXT``), at temperature T: every next-token position is one distribution. π_θ: a copy
whose weights moved by ``--shift`` times each tensor's RMS (Gaussian, seed 0), a stand-in for an update or an engine's
rounding, at the same T (the bias depends on how much of π_b's mass its top k holds, which T sets). Float64. For each
(T, k): π_b's mean top-k mass, the exact KL and the bound ``objectives.kl.top_k_kl_lower_bound`` (token means, nats)
and their ratio. One JSON line per (T, k) in bench/results/top_k_kl_bound.jsonl. A few seconds on one CPU core.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import record  # noqa: E402

TEXT = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a big dog came to the park. The dog was very happy and wanted to play with Lily.",
    "Tom had a red ball. He threw the ball to his friend, and they laughed and ran in the sun.",
    "The cat was sad because it was raining. Mom gave the cat a warm blanket and it felt better.",
]


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from trustbatch.objectives.kl import exact_kl, top_k_kl_lower_bound

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,5,20,50")
    ap.add_argument("--temperatures", default="0.6,1.0,1.5")
    ap.add_argument("--shift", type=float, default=0.01, help="π_θ's weight shift, in units of each tensor's RMS")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    shared = Path(os.environ.get("TRUSTBATCH_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    model_dir = shared / "models" / "stories260K-hf"
    if not model_dir.is_dir():
        sys.exit(f"top_k_kl_bound: no {model_dir}; set TRUSTBATCH_SHARED to the folder that holds models/stories260K-hf")
    tok = AutoTokenizer.from_pretrained(model_dir)
    behaviour = LlamaForCausalLM.from_pretrained(model_dir).double().eval()
    policy = copy.deepcopy(behaviour)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(a.shift * p.pow(2).mean().sqrt() * torch.randn(p.shape, generator=g, dtype=p.dtype))
        ids = [torch.tensor([tok(t)["input_ids"]]) for t in TEXT]
        z_b, z_t = (torch.cat([m(x).logits[0, :-1] for x in ids]) for m in (behaviour, policy))
    arms = {}
    for T in (float(t) for t in a.temperatures.split(",")):
        lq, lp = torch.log_softmax(z_b / T, -1), torch.log_softmax(z_t / T, -1)
        exact = exact_kl(lp, lq)
        for k in (int(k) for k in a.ks.split(",")):
            top_lq, top_ids = lq.topk(k, -1)
            bound = top_k_kl_lower_bound(lp, top_lq, top_ids)
            arms[f"T={T:g},k={k}"] = dict(
                temperature=T, k=k, positions=int(lq.shape[0]), top_k_mass=float(top_lq.exp().sum(-1).mean()),
                exact_kl=float(exact.mean()), bound=float(bound.mean()), ratio=float(bound.mean() / exact.mean()))
    record("top_k_kl_bound", arms, extra={"model": "stories260K-hf", "V": int(z_b.shape[-1]), "shift": a.shift},
           save=not a.no_save)


if __name__ == "__main__":
    main()
