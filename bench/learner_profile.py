"""Where the learner step's time goes: the 0.5B-shaped learner step under torch.profiler, shares per op class.

    python bench/learner_profile.py                           # CUDA: Qwen2.5-0.5B shape, bf16-mixed, chunked head
    python bench/learner_profile.py --device cpu --layers 2 --rows 4 --prompt 64 --completion 64   # on a CPU
    python bench/learner_profile.py --device cpu --layers 1 --vocab 1024 --rows 2 --prompt 8 --completion 8 --steps 1

The model is random-initialised from Qwen2.5-0.5B's config (``scale_rehearsal.QWEN25_05B``; ``--layers`` and
``--vocab`` shrink it for a CPU), the batch ``gpu_check.rl_batch``'s (distinct prompts, full-length completions),
the step ``Learner.step`` with GRPO. One warm-up step, then ``--steps`` steps profiled. Each op's *self* time (device
time on CUDA, CPU time on a CPU) goes to one class:

- ``lm_head``: anything under the LM head and log-softmax (``chunked_logprobs``'s forward and backward, the full
  path's forward, wrapped in a ``record_function`` range here: nothing changes in the library); the full path's
  backward (C ≤ ``--chunk``) runs as autograd nodes outside any range: only its log-softmax is classed here, its
  head matmul goes to ``matmul``;
- ``optimizer``: anything under ``Optimizer.step`` (AdamW) and ``clip_grad_norm_``;
- ``attention``: scaled-dot-product / flash / efficient attention kernels and eager softmax;
- ``matmul``: mm, addmm, bmm, matmul, linear (outside the LM head);
- ``norm_activation``: the element-wise math of RMSNorm, SiLU, RoPE and residuals (pow, rsqrt, mean, mul, add, silu...);
- ``casts``: dtype conversions and copies (``_to_copy``, ``copy_``);
- ``other``: every other op (embedding, gather, index, fill, ...);
- ``idle``: wall time of the profiled steps not covered by any op: on CUDA the GPU waiting for the host (launch
  overhead, Python, synchronisation), on a CPU the Python and framework time between ops.

Shares are of the profiled steps' wall time. MFU as ``gpu_check``: 6 · parameters · tokens / s over 989 TFLOP/s
(bf16 dense, H100/H200 SXM spec); on a CPU it is printed against that spec too, which says nothing but keeps one format.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402

CLASSES = ("matmul", "attention", "norm_activation", "lm_head", "optimizer", "casts", "other", "idle")
_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "aten::addmm_",
           "aten::_addmm_activation"}
_ELEMENTWISE = {"aten::pow", "aten::rsqrt", "aten::mean", "aten::mul", "aten::mul_", "aten::add", "aten::add_",
                "aten::silu", "aten::silu_backward", "aten::sub", "aten::div", "aten::neg", "aten::cat", "aten::sum",
                "aten::cos", "aten::sin", "aten::sigmoid", "aten::rsub", "aten::addcmul_", "aten::addcdiv_",
                "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward", "aten::rms_norm"}
_CASTS = {"aten::_to_copy", "aten::copy_", "aten::to"}


def op_class(name: str) -> str:
    """The class of one op by its name (the LM head and optimizer are classed by their enclosing range)."""
    low = name.lower()
    if "log_softmax" in low:  # the full head's backward, which runs outside the head's range
        return "lm_head"
    if "attention" in low or "scaled_dot_product" in low or "softmax" in low or "flash" in low:
        return "attention"
    if name in _MATMUL:
        return "matmul"
    if name in _ELEMENTWISE:
        return "norm_activation"
    if name in _CASTS:
        return "casts"
    return "other"


def _range_class(evt) -> str | None:
    while evt is not None:
        if evt.name == "trustbatch::lm_head":
            return "lm_head"
        if evt.name.startswith("Optimizer.") or evt.name == "trustbatch::clip_grad_norm":
            return "optimizer"
        evt = evt.cpu_parent
    return None


def shares(events, wall_us: float, device: str) -> dict[str, float]:
    """Each class's share of ``wall_us`` from the profiler's events: the ops' self times (on CUDA their kernels' time,
    which the profiler adds to the launching op as well as listing each kernel as an event of its own; the kernel
    events are skipped), so nothing is counted twice."""
    total: dict[str, float] = defaultdict(float)
    for evt in events:
        if evt.name.startswith("trustbatch::") or evt.name.startswith("Optimizer.") or evt.name.startswith("ProfilerStep"):
            continue
        if evt.device_type != DeviceType.CPU:  # a kernel: its time is counted in the op that launched it
            continue
        t = evt.self_device_time_total if device == "cuda" else evt.self_cpu_time_total
        if t:
            total[_range_class(evt) or op_class(evt.name)] += t
    busy = sum(total.values())
    total["idle"] = max(wall_us - busy, 0.0)
    return {k: total.get(k, 0.0) / max(wall_us, busy, 1e-9) for k in CLASSES}


def _ranged(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with torch.profiler.record_function(name):
            return fn(*a, **k)
    return wrapper


def mark_lm_head_and_clip() -> None:
    """Wrap the LM head's forward and backward, and the gradient clip, in named profiler ranges."""
    from trustbatch.policy import chunked_logprobs as cl
    from trustbatch.policy import forward, packed, shared_prompt

    cl._ChunkedHead.backward = staticmethod(_ranged(cl._ChunkedHead.backward, "trustbatch::lm_head"))
    for mod in (forward, shared_prompt, packed):
        for fn in ("head_logprobs", "full_logprobs"):
            if hasattr(mod, fn):
                setattr(mod, fn, _ranged(getattr(mod, fn), "trustbatch::lm_head"))
    torch.nn.utils.clip_grad_norm_ = _ranged(torch.nn.utils.clip_grad_norm_, "trustbatch::clip_grad_norm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default Qwen2.5-0.5B's 151,936)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=768)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256, help="logprob_chunk_size (below --completion: chunked head)")
    ap.add_argument("--precision", default=None, help="float32 or bf16-mixed (default: bf16-mixed on CUDA, else float32)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--padding-free", action="store_true")
    ap.add_argument("--compile", action="store_true", help="train.compile: each decoder block's training forward "
                                                           "through torch.compile (inductor)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --layers/--vocab/--rows to shrink the step)")
    precision = a.precision or ("bf16-mixed" if a.device.startswith("cuda") else "float32")
    gpu_check.DEVICE = "cuda" if a.device.startswith("cuda") else "cpu"
    from trustbatch.trainer import Learner

    vocab = gpu_check.VOCAB = a.vocab or gpu_check.VOCAB
    mark_lm_head_and_clip()
    model = gpu_check.qwen_05b(layers=a.layers)
    n_params = sum(p.numel() for p in model.parameters())
    batch = gpu_check.rl_batch(a.rows, a.prompt, a.completion, vocab)
    learner = Learner(model, "grpo", micro_batch_size=a.micro_batch, precision=precision, warmup_steps=0,
                      activation_checkpointing=a.activation_checkpointing, logprob_chunk_size=a.chunk,
                      padding_free=a.padding_free, compile_backend="inductor" if a.compile else None)
    for _ in range(2 if a.compile else 1):  # warm-up: allocator, autotuning, lazy init; compile and its recompile
        learner.step(batch)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu_check.DEVICE == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    times = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(a.steps):
            gpu_check.sync()
            t = time.perf_counter()
            learner.step(batch)
            gpu_check.sync()
            times.append(time.perf_counter() - t)
    if a.trace:
        prof.export_chrome_trace(a.trace)
    wall = sum(times)
    share = shares(prof.events(), wall * 1e6, gpu_check.DEVICE)
    tokens = a.rows * (a.prompt + a.completion)
    s = statistics.median(times)
    flops = 6 * n_params * tokens / s  # profiled: the profiler's own overhead lowers this a little
    print(f"{n_params / 1e6:.0f}M parameters ({a.layers} layers, V = {vocab}), {a.rows} rows × {a.prompt} + "
          f"{a.completion} tokens, micro-batch {a.micro_batch}, {precision}, chunk {a.chunk}, {a.device}: "
          f"step {s:.3f} s (profiled), {tokens / s:,.0f} tokens/s, MFU {flops / gpu_check.PEAK_SPEC:.1%} of 989 TFLOP/s")
    for k in CLASSES:
        print(f"{k:>16}: {share[k]:6.1%}")
    print(json.dumps({"bench": "learner_profile", "device": a.device, "layers": a.layers, "vocab": vocab,
                      "params": n_params, "rows": a.rows, "prompt": a.prompt, "completion": a.completion,
                      "micro_batch": a.micro_batch, "precision": precision, "chunk": a.chunk,
                      "activation_checkpointing": a.activation_checkpointing, "padding_free": a.padding_free,
                      "compile": a.compile,
                      "step_s": [round(x, 4) for x in times], "tokens_per_s": round(tokens / s),
                      "mfu_spec": round(flops / gpu_check.PEAK_SPEC, 4),
                      "shares": {k: round(v, 4) for k, v in share.items()}}), flush=True)


if __name__ == "__main__":
    main()
