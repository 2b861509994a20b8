"""bf16-mixed against float32: the learner's gradient error on the trained default base, with on-policy completions.

    python bench/bf16_gradients.py [--batches 4] [--objectives p3o,grpo] [--threads 1]

The default job's first ``--batches`` rollout batches (64 prompts × 8 samples, 8 new tokens, the default task and
reward), sampled by the default base shipped under ``src/trustbatch/policy/bases`` (float32, its own policy: on
policy), are each given to a float32 learner and to a bf16-mixed one (the default settings otherwise; one
micro-batch; no clipping, no optimizer step). Per objective and batch: the relative L2 error
‖g_bf16 − g_32‖ / ‖g_32‖ of the whole parameter gradient and the cosine between them; and the prediction
u·κ (``tests/support/bf16_rounding.py``: bf16's unit round-off u = 2^-8 times the gradient's amplification κ of
random relative perturbations of size u at every matrix product, measured in float64 on the same batch, 3 draws).
One JSON line per objective (median, min, max over batches) in ``bench/results/bf16_gradients.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from bf16_rounding import U_BF16, amplification  # noqa: E402
from harness import options, record  # noqa: E402


def gradient(model, batch, objective, opts, precision="float32", mode=None) -> torch.Tensor:
    """The learner's flat gradient of one optimizer step on ``batch`` (a copy of ``model``; nothing updated)."""
    from trustbatch.trainer import Learner

    m = copy.deepcopy(model)
    learner = Learner(m, objective, opts, micro_batch_size=len(batch), lr=0.0, grad_clip=1e30, precision=precision)
    learner.optimizer.step = lambda: None
    learner.optimizer.zero_grad = lambda **k: None
    if mode is None:
        learner.step(batch)
    else:
        with mode:
            learner.step(batch)
    return torch.cat([p.grad.flatten().double() for p in m.parameters() if p.grad is not None])


def default_batches(n: int):
    """(policy, the default job's first ``n`` batches, the default objective options) from the shipped base."""
    from trustbatch.config import load_config
    from trustbatch.recipes.build import build_parts, prepare_run

    cfg = load_config(overrides=["reward.workers=0"])
    task, policy, pool, source = prepare_run(cfg)
    print(f"base: {source}", flush=True)
    built = build_parts(cfg, task, policy, pool)
    batches = [built.parts.source.make_batch(b) for b in range(n)]
    return policy, batches, cfg


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--objectives", default="p3o,grpo")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    policy, batches, cfg = default_batches(a.batches)
    model = copy.deepcopy(policy.model).float()
    model64 = copy.deepcopy(model).double()
    arms = {}
    for name in a.objectives.split(","):
        opts = dict(cfg.objective.options) if name == cfg.objective.name else {}
        rel, cos, pred = [], [], []
        for batch in batches:
            g32 = gradient(model, batch, name, opts)
            g16 = gradient(model, batch, name, opts, precision="bf16-mixed")
            rel.append(float((g16 - g32).norm() / g32.norm()))
            cos.append(float(torch.nn.functional.cosine_similarity(g16, g32, dim=0)))
            kappa = amplification(lambda mode: gradient(model64, batch, name, opts, mode=mode))
            pred.append(U_BF16 * kappa)
            print(f"{name}: rel {rel[-1]:.4f} cos {cos[-1]:.5f} predicted u*kappa {pred[-1]:.4f}", flush=True)
        arms[name] = {"rel_l2": rel, "cosine": cos, "predicted_u_kappa": pred,
                      "rel_over_predicted": [r / p for r, p in zip(rel, pred)]}
    record("bf16_gradients", arms, extra={"model": "the shipped default base", "batches": a.batches,
                                          "rows": len(batches[0]), "threads": a.threads}, save=not a.no_save)


if __name__ == "__main__":
    main()
