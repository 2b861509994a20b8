"""Peak memory and time of the learner's log-probs: the full LM head against the chunked one (``policy.chunked_logprobs``).

    python bench/logprob_memory.py [--shape qwen|default|both] [--chunk 1024] [--repeats 3] [--threads 1]
                                   [--device cpu|cuda] [--precision float32|bf16-mixed] [--frozen-head]

One measurement is what the learner does per micro-batch: the LM head on final hidden states, log-probs
at the sampled tokens with the entropy (no gradient), and the backward of Σ cotangent·log-prob into the
hidden states (a leaf with gradient) and the LM-head weight (float32). No model: the decoder's memory
is the same in both arms. Shapes:

* ``qwen``: one row of C = 4,096 completion positions, V = 151,936, H = 896 (Qwen2.5-0.5B's head);
* ``default``: the default job's micro-batch, 512 rows × C = 8, V = 384, H = 128. There the learner
  itself takes the full path (its B · (C + 1) logits fit ``train.logprob_chunk_size=auto``), op for op; the
  chunked arm shows what the chunked head would cost at ``--default-chunk`` tokens (1,024: 512 rows × 2 columns).

``full`` is the full path (``chunked_logprobs.full_logprobs`` on [B, C, V] logits, autograd); ``chunked``
is ``chunked_logprobs`` at ``--chunk`` tokens per chunk (rows × columns; one row here, so columns). Memory on CPU: each arm runs in a fresh subprocess,
and its peak is ``ru_maxrss`` minus the resident set after its inputs were allocated (so the
interpreter, torch and the inputs are not counted; page-cache noise is a few MB): the peak is VmHWM
after resetting it (``/proc/self/clear_refs``), or ``ru_maxrss`` where that cannot be reset. On CUDA:
``max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory allocated before the
arm. Time: forward + backward, wall clock (synchronised on CUDA), after a small untimed warm-up.
``--precision bf16-mixed`` runs both arms under bf16 autocast, as the learner's ``train.precision=bf16-mixed``
does: the head's matrix products in bf16, the log-softmax in float32 (``chunked_logprobs.logits_dtype``). In
float32 the chunked arm's recomputation of the logits in backward is a fourth matrix product of [tokens, H] × [H, V]
beside the full path's three, so where those products dominate the time, 4/3 of the full path's is its floor; in
bf16 they are cheaper, and the float32 log-softmax's memory traffic weighs more.
Arms are interleaved, ``--repeats`` times; one JSON line per arm (median and range), then the ratio.
``--frozen-head``: the LM-head weight takes no gradient (LoRA's frozen head): the full path's backward runs one
product (the hidden states' gradient), and the chunked head forms that gradient in its forward (one product more
there, none in backward), so both arms run two products; a third arm, ``chunked_recompute``, runs the chunked head
with the backward a trained head takes (the logits recomputed per chunk: three products), as before this path.
The values of the two arms are also compared (max |Δ log-prob|, relative Δ of the hidden states' gradient and of the
weight's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from trustbatch.policy.chunked_logprobs import chunked_logprobs, full_logprobs

SHAPES = {"qwen": dict(B=1, C=4096, V=151_936, H=896), "default": dict(B=512, C=8, V=384, H=128)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM; Linux ≥ 4.0). ``ru_maxrss`` cannot be reset, and a child
    inherits its parent's high-water mark across fork and exec."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset: bool) -> int:
    if reset:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(B, C, V, H, device, frozen_head=False):
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(B, C, H, generator=g) * 0.5).to(device).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * H ** -0.5).to(device).requires_grad_(not frozen_head)
    y = torch.randint(0, V, (B, C), generator=g).to(device)
    cot = torch.randn(B, C, generator=g).to(device)
    return h, w, y, cot


def _run(arm: str, h, w, y, cot, chunk: int, precision: str = "float32"):
    bf16 = precision == "bf16-mixed"
    if arm == "chunked_recompute":  # the frozen head without its forward-formed gradient
        import trustbatch.policy.chunked_logprobs as cl

        cl._direct = lambda *a: False
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=bf16):
        if arm == "full":
            logp, ent = full_logprobs(torch.nn.functional.linear(h, w), y, with_entropy=True)
        else:
            logp, ent, _ = chunked_logprobs(h, w, None, y, chunk_size=chunk, with_entropy=True)
    (logp * cot).sum().backward()
    return logp.detach(), float(ent.sum())


def child(arm: str, shape: str, chunk: int, device: str, threads: int, precision: str = "float32",
          frozen_head: bool = False) -> dict:
    """One measurement of ``arm`` in this (fresh) process."""
    torch.set_num_threads(threads)
    s = SHAPES[shape]
    small = _inputs(2, 16, 1000, 32, device)  # warm-up: kernels and thread pools, not the measured shapes
    _run(arm, *small, chunk=4, precision=precision)
    del small
    h, w, y, cot = _inputs(**s, device=device, frozen_head=frozen_head)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset = _reset_peak_rss()
        base = _rss_bytes()
    t0 = time.perf_counter()
    logp, _ = _run(arm, h, w, y, cot, chunk, precision)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss_bytes(reset) - base
    torch.save({"logp": logp.cpu(), "h_grad": h.grad.cpu(), "w_grad": None if w.grad is None else w.grad.cpu()},
               os.environ["LOGPROB_BENCH_OUT"])
    return {"peak_mb": peak / 2 ** 20, "time_s": dt}


def _spawn(arm, shape, chunk, device, threads, out, precision="float32", frozen_head=False) -> dict:
    env = {**os.environ, "LOGPROB_BENCH_OUT": out, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--child", arm, "--shape", shape, "--chunk", str(chunk), "--device", device,
           "--threads", str(threads), "--precision", precision] + (["--frozen-head"] if frozen_head else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{arm} {shape} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _summary(xs):
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk at the qwen shape (one row: columns)")
    ap.add_argument("--default-chunk", type=int, default=1024,
                    help="tokens per chunk at the default shape (512 rows x 2 columns)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["float32", "bf16-mixed"], default="float32")
    ap.add_argument("--frozen-head", action="store_true", help="the LM-head weight without gradient (LoRA)")
    ap.add_argument("--child", choices=["full", "chunked", "chunked_recompute"])
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.shape, a.chunk, a.device, a.threads, a.precision, a.frozen_head)))
        return
    import tempfile

    shapes = list(SHAPES) if a.shape == "both" else [a.shape]
    for shape in shapes:
        chunk = a.chunk if shape == "qwen" else a.default_chunk
        runs = {"full": [], "chunked": [], **({"chunked_recompute": []} if a.frozen_head else {})}
        outs = {}
        with tempfile.TemporaryDirectory() as d:
            for _ in range(a.repeats):
                for arm in runs:  # interleaved
                    outs[arm] = os.path.join(d, f"{arm}.pt")
                    runs[arm].append(_spawn(arm, shape, chunk, a.device, a.threads, outs[arm], a.precision,
                                            a.frozen_head))
            full, chunked = (torch.load(outs[k]) for k in ("full", "chunked"))
        dlogp = float((full["logp"] - chunked["logp"]).abs().max())
        rel = {k: None if full[k] is None else float((full[k] - chunked[k]).abs().max() / full[k].abs().max())
               for k in ("h_grad", "w_grad")}
        med = {}
        for arm, rs in runs.items():
            rec = {"shape": shape, **SHAPES[shape], "arm": arm, "chunk": chunk if arm != "full" else None,
                   "device": a.device, "threads": a.threads, "repeats": a.repeats, "precision": a.precision,
                   "frozen_head": a.frozen_head,
                   "peak_mb": _summary([r["peak_mb"] for r in rs]), "time_s": _summary([r["time_s"] for r in rs])}
            med[arm] = rec
            print(json.dumps(rec))
        ratios = {f"ratio_{arm}_over_full": {k: round(med[arm][k]["median"] / med["full"][k]["median"], 4)
                                            for k in ("peak_mb", "time_s")} for arm in runs if arm != "full"}
        print(json.dumps({"shape": shape, "precision": a.precision, "frozen_head": a.frozen_head, **ratios,
                          "max_abs_dlogp": dlogp, "hidden_grad_rel_diff": rel["h_grad"],
                          "weight_grad_rel_diff": rel["w_grad"]}))


if __name__ == "__main__":
    main()
