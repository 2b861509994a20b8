"""torch.compile trial: the learner's forward + loss + backward on the default job, eager against compiled.

    python bench/trials/compile_trial.py [--threads 2] [--batches 3] [--repeats 5] [--mode default] [--tiny]

Rollout batches of the default job (``load_config(None, [])``; ``--tiny``: tests/support/tiny.py's config, to
check that the script runs) are sampled once; then, for the shared-prompt and the plain learner
forward, the same batches go through forward + objective loss + backward with the policy eager and
with ``torch.compile(policy)`` (inductor). Printed per variant:

- compile time: the first compiled call of each new batch shape minus the eager median of that
  batch (batches differ in prompt and completion width, so a run also meets recompilation);
- the median seconds per forward + loss + backward over ``--repeats`` passes of every batch,
  eager and compiled interleaved, with the 1-minute load average beside it;
- exactness: max |Δ| of the loss and of every parameter gradient, compiled against eager, on each batch.

Only the policy module is compiled: the objectives check their inputs in Python (one-line errors,
non-finite checks) and would break a graph at every check. Nothing here changes the trainer; compile
stays off by default. On a shared machine the timings mean little: compare only runs of one quiet
machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from trustbatch.policy.forward import response_logprobs
from trustbatch.policy.shared_prompt import grouped_response_logprobs


def load() -> float:
    return os.getloadavg()[0]


def setup(a):
    """(policy model, learner, a list of default-job TrainBatches)."""
    from trustbatch.config import load_config
    from trustbatch.recipes.build import build_parts, prepare_run

    overrides = []
    if a.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
        from tiny import TINY

        overrides = TINY + ["reward.workers=0"]
    cfg = load_config(None, overrides)
    task, policy, pool, src = prepare_run(cfg)
    built = build_parts(cfg, task, policy, pool)
    source, learner = built.parts.source, built.parts.learner
    batches = [source.next_batch(learner.version) for _ in range(a.batches)]
    pool.close()
    print(f"{'tiny' if a.tiny else 'default'} job: base {src}, {sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M "
          f"parameters, objective {learner.spec.name}, {a.threads} threads; batches (rows, L, C): "
          + ", ".join(f"({len(b)}, {b.packed.input_ids.shape[1]}, {b.packed.response_mask.shape[1]})" for b in batches))
    return policy.model, learner, [b for b in batches if b is not None]


def fwd_loss_bwd(model, forward, learner, batch):
    """(seconds, loss, {name: grad}) of one forward + objective loss + backward of ``batch`` (one micro-batch).

    ``model`` is the policy or its compiled wrapper; gradients are read from the policy's own parameters.
    """
    params = dict(getattr(model, "_orig_mod", model).named_parameters())
    for p in params.values():
        p.grad = None
    m = batch.packed.response_mask
    t = time.perf_counter()
    logp, _ = forward(model, batch.packed, with_entropy=True)
    out = learner.spec.fn(logp, batch.behavior_logprobs, batch.advantages, m, num_tokens=float(m.sum()),
                          num_sequences=float((m.sum(1) > 0).sum()), **learner.options)
    out.loss.backward()
    dt = time.perf_counter() - t
    return dt, float(out.loss.detach()), {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}


def trial(model, learner, batches, forward, name, a) -> None:
    # compiled and eager share the parameters: the gradients of one land on the same tensors
    compiled = torch.compile(model, mode=None if a.mode == "default" else a.mode)
    eager_t: dict[int, list[float]] = {i: [] for i in range(len(batches))}
    comp_t: dict[int, list[float]] = {i: [] for i in range(len(batches))}
    first: list[float] = []
    loss_diff = grad_diff = 0.0
    for i, b in enumerate(batches):  # warm eager once per shape, then the compiled first call (compilation)
        fwd_loss_bwd(model, forward, learner, b)
        dt, _, _ = fwd_loss_bwd(compiled, forward, learner, b)
        first.append(dt)
    for r in range(a.repeats):
        for i, b in enumerate(batches):
            order = ((model, eager_t), (compiled, comp_t)) if r % 2 == 0 else ((compiled, comp_t), (model, eager_t))
            res = {}
            for mod, store in order:
                dt, loss, grads = fwd_loss_bwd(mod, forward, learner, b)
                store[i].append(dt)
                res[mod is compiled] = (loss, grads)
            (le, ge), (lc, gc) = res[False], res[True]
            loss_diff = max(loss_diff, abs(lc - le))
            grad_diff = max(grad_diff, max(float((gc[n] - ge[n]).abs().max()) for n in ge))
    eager = [statistics.median(v) for v in eager_t.values()]
    comp = [statistics.median(v) for v in comp_t.values()]
    compile_s = [f - e for f, e in zip(first, eager)]
    print(f"{name:>7}: eager {statistics.mean(eager):.3f} s, compiled {statistics.mean(comp):.3f} s per fwd+loss+bwd "
          f"({statistics.mean(comp) / statistics.mean(eager):.2f}×); compile time per batch shape "
          + ", ".join(f"{c:.1f}" for c in compile_s) + " s"
          f"; max |Δ loss| {loss_diff:.2e}, max |Δ grad| {grad_diff:.2e}  (load {load():.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3, help="rollout batches (distinct shapes) to time on")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", default="default", help="torch.compile mode: default, reduce-overhead, max-autotune")
    ap.add_argument("--tiny", action="store_true", help="tests/support/tiny.py's config: checks the script runs, times nothing useful")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, learner, batches = setup(a)
    model.train()
    for name, forward in (("shared", grouped_response_logprobs), ("plain", response_logprobs)):
        torch._dynamo.reset()  # each forward compiles from scratch: its compile time is its own
        trial(model, learner, batches, forward, name, a)


if __name__ == "__main__":
    main()
