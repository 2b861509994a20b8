"""The GPU check: one script, one call, at most ~8 minutes on one H100/H200, with only what that machine has.

    make gpu-wheels                       # here: what trustbatch needs beyond the GPU image, into .whl/
    make gpu-check                        # there: installs .whl, runs `make test-gpu`, then this script (~8 min)
    python bench/gpu_check.py --device cpu   # a dry run on a CPU: every section at toy sizes

Sections (each one JSON line, also appended to OUT/gpu_check.jsonl; a section that fails prints its error and the
rest go on). Numbered by topic; they run in ``--sections``' order: env, learner, train, padding_free, profile,
engine, fsdp2_ws1, logprob_memory, compile:

1. ``env``: torch, CUDA, GPU, transformers, peft.
2. ``learner``: forward+backward tokens/s and MFU of the learner on a Qwen2.5-0.5B-shaped model (random init) in
   bf16-mixed with chunked log-probs, with and without activation checkpointing. MFU = 6 · parameters · tokens / s
   over the bf16 dense peak (989 TFLOP/s, H100/H200 SXM spec; ~790 measured on these machines): the LM head is
   counted once (tied embeddings), attention's quadratic FLOPs and checkpointing's recompute are not.
3. ``engine``: the transformers engine's new tokens/s, sampling from the learner's module under its autocast, per
   decode loop (``rollout.decode``: dynamic, static_compiled), noise stream (``rollout.noise``) and rows (128, 512;
   ``--engine-runs``), 256 new tokens (dynamic: 64), within ``--engine-budget`` seconds (issue 44 item 1); beside
   them transformers' own continuous batching (``continuous_batching``, ``generate_batch``), as a reference.
4. ``fsdp2_ws1``: FSDP2 (``fully_shard`` per block and root) at world size 1 on NCCL: one learner step against the
   unsharded learner (float32: the same update to round-off) and its time.
5. ``logprob_memory``: ``bench/logprob_memory.py --device cuda --shape qwen`` (chunked against full: peak CUDA
   memory, time), in
   float32 and under bf16 autocast (``--precision bf16-mixed``, what the learner's head runs in bf16-mixed), and
   under bf16 autocast with the head frozen (``--frozen-head``, LoRA's case: no logits recomputed in backward).
6. ``train``: ``trustbatch train train.device=cuda train.steps=3`` of the default job, float32 and bf16-mixed.
7. ``padding_free``: the ``learner`` section's step with mixed completion lengths, padded against padding-free
   (``train.padding_free``), tokens/s counting real tokens.
8. ``profile``: ``bench/learner_profile.py`` (the learner step's time per op class).
9. ``compile``: the ``learner`` section's step with ``train.compile`` (regional inductor compile), last because its
   compile takes a minute or more.

``--device cpu`` is a dry run: every size not given on the command line takes a toy value (``DRY``: one layer,
V = 1,024, a few rows, the tiny job of tests/support/tiny.py for ``train``), so the sections' code runs in minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
PEAK_SPEC, PEAK_MEASURED = 989e12, 790e12


def emit(out: Path, section: str, **fields) -> None:
    line = {"section": section, **fields}
    print(json.dumps(line), flush=True)
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def section(fn):
    def run(out: Path, *a):
        t = time.perf_counter()
        try:
            fn(out, *a)
        except Exception as e:  # noqa: BLE001 - one section's failure is reported, the others still run
            emit(out, fn.__name__, error=f"{type(e).__name__}: {e}".splitlines()[0][:400],
                 trace=traceback.format_exc()[-1500:])
        print(f"[{fn.__name__}: {time.perf_counter() - t:.1f}s]", flush=True)
    return run


DEVICE = "cuda"  # --device cpu runs the sections' code on the CPU (a dry run before the GPU call)
LAYERS = 24
VOCAB = 151936
# sizes: on a GPU, and for --device cpu (a dry run) when not given
SIZES = dict(rows=16, prompt=256, completion=768, micro_batch=8, chunk=2048, layers=24, vocab=151936, steps=5,
             engine_samples=8, engine_tokens=256, train_steps=3)
DRY = dict(rows=4, prompt=8, completion=24, micro_batch=2, chunk=8, layers=1, vocab=1024, steps=1,
           engine_samples=2, engine_tokens=8, train_steps=1)
# the engine section's runs (its docstring): the goal's 512 rows first; the budget cuts the tail
ENGINE = dict(runs="512/static_compiled+philox,512/continuous_batching,512/static_compiled,512/dynamic,128/static_compiled+philox,128/dynamic,"
                   "128/static_compiled,128/dynamic:1", dynamic_tokens=64, budget=400.0)
ENGINE_DRY = dict(runs="8/static_compiled+philox,8/static,8/dynamic,4/dynamic:1,8/continuous_batching", dynamic_tokens=8, budget=600.0)


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def qwen_05b(seed: int = 0, layers: int | None = None):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from scale_rehearsal import QWEN25_05B

    cfg = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers or LAYERS, "vocab_size": VOCAB}, bos_token_id=1,
                      eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        return Qwen2ForCausalLM(cfg)


def rl_batch(rows: int, prompt: int, completion: int, vocab: int, seed: int = 0, min_completion: int | None = None):
    """Distinct random prompts (no prompt sharing: every token is computed) with full-length completions, or with
    lengths spread evenly over [min_completion, completion]."""
    import torch

    from trustbatch.pipeline.batch import TrainBatch
    from trustbatch.policy.forward import pack

    g = torch.Generator().manual_seed(seed)
    lo = completion if min_completion is None else min_completion
    prompts = [[1] + torch.randint(3, vocab, (prompt - 1,), generator=g).tolist() for _ in range(rows)]
    comps = [torch.randint(3, vocab, (lo + (completion - lo) * i // max(rows - 1, 1),), generator=g).tolist()
             for i in range(rows)]
    packed = pack(prompts, comps, 0)
    blp = torch.where(packed.response_mask, -torch.rand(rows, completion, generator=g) * 2 - 8, 0.0)  # C = completion
    return TrainBatch(packed, blp, torch.randn(rows, generator=g))


@section
def env(out: Path) -> None:
    import peft
    import torch
    import transformers

    gpu = torch.cuda.is_available()
    emit(out, "env", torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0) if gpu else None,
         memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpu else None,
         transformers=transformers.__version__, peft=peft.__version__)


def _time_steps(learner, batch, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        learner.step(batch)
        sync()
        times.append(time.perf_counter() - t)
    return times


@section
def learner(out: Path, a) -> None:
    _learner_arms(out, a, "learner", ((False, False), (True, False)))


def _learner_arms(out: Path, a, name: str, arms) -> None:
    """One line per (activation checkpointing, regional compile) arm: the median step after two warm-up steps."""
    import statistics

    import torch

    from trustbatch.trainer import Learner

    rows, prompt, completion = a.rows, a.prompt, a.completion
    batch = rl_batch(rows, prompt, completion, VOCAB)
    tokens = rows * (prompt + completion)
    for ckpt, compiled in arms:
        model = qwen_05b()
        n_params = sum(p.numel() for p in model.parameters())
        lr = Learner(model, "grpo", micro_batch_size=a.micro_batch, precision="bf16-mixed",
                     activation_checkpointing=ckpt, logprob_chunk_size=a.chunk, warmup_steps=0,
                     compile_backend="inductor" if compiled else None)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = _time_steps(lr, batch, 2)[1:] + _time_steps(lr, batch, a.steps)
        s = statistics.median(times[1:])
        flops = 6 * n_params * tokens / s
        emit(out, name, activation_checkpointing=ckpt, compile=compiled, precision="bf16-mixed",
             logprob_chunk_size=a.chunk,
             params=n_params, rows=rows, prompt=prompt, completion=completion, micro_batch=a.micro_batch,
             step_s_median=round(s, 4), step_s=[round(x, 4) for x in times[1:]], tokens_per_s=round(tokens / s),
             tflops=round(flops / 1e12, 1), mfu_spec=round(flops / PEAK_SPEC, 4),
             mfu_measured_peak=round(flops / PEAK_MEASURED, 4),
             peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None)
        del lr, model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


@section
def compile(out: Path, a) -> None:  # noqa: A001 - the section's name on the command line
    """The ``learner`` section's step with ``train.compile`` (regional inductor compile; compare with its eager
    arm), last in the order: its compile takes a minute or more, so a check short of time loses only this section.
    Its first steps compile and recompile: they are the warm-up, outside the timing."""
    _learner_arms(out, a, "compile", ((False, True),))


@section
def engine(out: Path, a) -> None:
    """New tokens/s of the transformers engine sampling from the learner's module under its bf16 autocast, one line
    per run (``--engine-runs``: ``rows/decode[+noise][:noise threads]``, in order; 8 samples per prompt,
    ``min(128, prompt)``-token prompts). A compiled run's first call (compile, CUDA-graph capture, then the whole
    decode) is timed apart (``first_call_s``) and the second one reported; ``dynamic`` runs decode
    ``--engine-dynamic-tokens`` new tokens (its per-token rate barely depends on the length, and 256 tokens of it at
    512 rows would take minutes). Runs start while the section has run less than ``--engine-budget`` seconds; the
    rest are reported skipped."""
    import torch

    from trustbatch.rollout import SamplingParams, TransformersEngine

    start = time.perf_counter()
    model = qwen_05b()
    g = torch.Generator().manual_seed(0)
    samples = a.engine_samples
    prompts = [[1] + torch.randint(3, VOCAB, (min(127, a.prompt),), generator=g).tolist() for _ in range(512)]
    for run in a.engine_runs.split(","):
        rows, kw = _engine_run(run)
        group = prompts[:max(1, rows // samples)]
        tokens = a.engine_dynamic_tokens if kw["decode"] == "dynamic" else a.engine_tokens
        line = dict(run=run, rows=len(group) * samples, prompt=len(group[0]), max_new_tokens=tokens, **kw,
                    autocast="bf16")
        if time.perf_counter() - start > a.engine_budget:
            emit(out, "engine", skipped=f"past --engine-budget {a.engine_budget:g}s", **line)
            continue
        if kw["decode"] == "continuous_batching":
            line.update(noise=None, noise_threads=None, autocast="none: bf16 weights")
            try:  # its API moves between transformers releases: a failure ends this run, not the section
                new, sec, first = _continuous_batching(model, group, samples, tokens)
            except Exception as e:  # noqa: BLE001
                emit(out, "engine", **line, error=f"{type(e).__name__}: {e}".splitlines()[0][:400])
                continue
            emit(out, "engine", **line, new_tokens=new, seconds=round(sec, 2), new_tokens_per_s=round(new / sec),
                 first_call_s=first, reference_only=True)
            continue
        eng = TransformersEngine(model, eos_id=2, pad_id=0, autocast=torch.bfloat16, **kw)
        sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=tokens)
        first = None
        sync()
        t = time.perf_counter()
        if kw["decode"] == "static_compiled":  # the timed call's own shape: compiles and captures it
            eng.generate(group, samples, sp)
            sync()
            first = round(time.perf_counter() - t, 2)
        else:
            eng.generate(group[:2], 2, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8))
        sync()
        t = time.perf_counter()
        rollouts = eng.generate(group, samples, sp)
        sync()
        sec = time.perf_counter() - t
        new = sum(len(r.completion_ids) for r in rollouts)
        emit(out, "engine", **line, new_tokens=new, seconds=round(sec, 2), new_tokens_per_s=round(new / sec),
             first_call_s=first, truncated=sum(r.truncated for r in rollouts))
        del eng, rollouts
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def _continuous_batching(model, prompts, samples: int, tokens: int):
    """(new tokens, seconds, first call's seconds) of transformers' own continuous batching (``generate_batch``:
    paged attention, its own scheduler and CUDA graphs) on a bf16 copy of ``model`` (its manager runs on a thread of
    its own, where the caller's autocast does not reach), sampling at T = 1 with no EOS. A reference for issue 44's
    choice between it and ``rollout.decode=static_compiled``: it records no processed log-probs of what it sampled
    (the engine protocol's behaviour log-probs), so it is measured here, not wired in as an engine."""
    import copy

    import torch
    from transformers import GenerationConfig

    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    cfg = GenerationConfig(max_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=-1, pad_token_id=0, num_return_sequences=samples)
    times, new = [], 0
    for _ in range(2):  # the first call sizes the cache and captures its graphs
        sync()
        t = time.perf_counter()
        out = bf16.generate_batch(inputs=prompts, generation_config=cfg)
        sync()
        times.append(time.perf_counter() - t)
        new = sum(len(o.generated_tokens) for o in out.values())
    del bf16
    return new, times[1], round(times[0], 2)


def _engine_run(run: str):
    """``rows/decode[+noise][:threads]`` → (rows, TransformersEngine keywords); e.g. ``512/static_compiled+philox``,
    ``128/dynamic:1`` (generator noise drawn on one thread, as before the stream drew on several)."""
    rows, _, arm = run.partition("/")
    arm, _, threads = arm.partition(":")
    decode, _, noise = arm.partition("+")
    return int(rows), dict(decode=decode, noise=noise or "generator", noise_threads=int(threads) if threads else None)


@section
def fsdp2_ws1(out: Path, a) -> None:
    import copy

    import torch.distributed as dist

    from trustbatch.parallel import _fully_shard, full_model_state
    from trustbatch.trainer import Learner

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    try:
        batch = rl_batch(min(8, a.rows), min(128, a.prompt), min(384, a.completion), VOCAB, seed=1)
        base = qwen_05b(seed=1)
        plain = copy.deepcopy(base)
        sharded = _fully_shard(copy.deepcopy(base), 1, None)
        res = {}
        for name, m in (("plain", plain), ("fsdp2", sharded)):
            lr = Learner(m, "grpo", micro_batch_size=4, logprob_chunk_size=a.chunk, warmup_steps=0)
            sync()
            t = time.perf_counter()
            lr.step(batch)
            sync()
            res[name] = time.perf_counter() - t
        full = full_model_state(sharded)
        ref = plain.state_dict()
        rel = max(float((full[k].to(ref[k].device).float() - ref[k].float()).norm() / ref[k].float().norm().clamp_min(1e-12))
                  for k in ref)
        emit(out, "fsdp2_ws1", first_step_s={k: round(v, 3) for k, v in res.items()},
             max_relative_weight_difference_after_one_step=rel, precision="float32")
    finally:
        dist.destroy_process_group()


@section
def logprob_memory(out: Path, a) -> None:
    script = ROOT / "bench" / "logprob_memory.py"
    shape = ["--shape", "default" if a.dry else "qwen"]  # the default shape's GPU numbers are on record (11-26)
    # the learner's head runs under bf16 autocast in bf16-mixed; LoRA's is frozen
    for precision, frozen in (("float32", False), ("bf16-mixed", False), ("bf16-mixed", True)):
        repeats = "2" if precision == "float32" else "1"
        p = subprocess.run([sys.executable, str(script), "--device", DEVICE, "--repeats", repeats, "--precision", precision,
                            *shape, *(["--frozen-head"] if frozen else [])], capture_output=True, text=True,
                           timeout=a.section_timeout, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        emit(out, "logprob_memory", precision=precision, frozen_head=frozen, returncode=p.returncode, lines=lines,
             stderr_tail=p.stderr[-600:] if p.returncode else "")


@section
def train(out: Path, a) -> None:
    tiny = []
    if a.dry:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from tiny import TINY as tiny
    for extra in ([], ["train.precision=bf16-mixed", "train.activation_checkpointing=true"]):
        run_dir = Path(a.work) / f"train-{'bf16' if extra else 'f32'}"
        cmd = [sys.executable, "-m", "trustbatch", "train", f"train.device={DEVICE}", f"train.steps={a.train_steps}",
               f"run_dir={run_dir}", "eval.every=1000"] + list(tiny) + extra
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.section_timeout,
                           env={**os.environ, "TRUSTBATCH_CACHE": str(Path(a.work) / "cache")})
        wall = time.perf_counter() - t
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").exists() else []
        rounds = [{k: r.get(k) for k in ("step", "reward_mean", "ess", "rollout_s", "step_s", "tokens_per_s")}
                  for r in recs if r.get("step", 0) > 0]
        emit(out, "train", overrides=extra, returncode=p.returncode, wall_s=round(wall, 1),
             base_heldout=summary.get("base_heldout_accuracy"), final_heldout=summary.get("final_heldout_accuracy"),
             rounds=rounds, stderr_tail=p.stderr[-800:] if p.returncode else "")


@section
def padding_free(out: Path, a) -> None:
    import statistics

    import torch

    from trustbatch.trainer import Learner

    batch = rl_batch(a.rows, a.prompt, a.completion, VOCAB, seed=2, min_completion=max(1, a.completion // 12))
    tokens = float(batch.packed.attention_mask.sum())
    res = {}
    for packed in (False, True):
        model = qwen_05b()
        lr = Learner(model, "grpo", micro_batch_size=a.micro_batch, precision="bf16-mixed", logprob_chunk_size=a.chunk,
                     warmup_steps=0, padding_free=packed)
        times = _time_steps(lr, batch, 1 + a.steps)[1:]
        res["packed" if packed else "padded"] = statistics.median(times)
        del lr, model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    emit(out, "padding_free", rows=a.rows, prompt=a.prompt, completions=[max(1, a.completion // 12), a.completion],
         real_tokens=tokens, padded_positions=batch.packed.input_ids.numel(), micro_batch=a.micro_batch,
         step_s={k: round(v, 4) for k, v in res.items()},
         real_tokens_per_s={k: round(tokens / v) for k, v in res.items()},
         packed_speedup=round(res["padded"] / res["packed"], 3))


@section
def profile(out: Path, a) -> None:
    script = ROOT / "bench" / "learner_profile.py"
    sizes = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("layers", "vocab", "rows", "prompt", "completion",
                                                                    "micro_batch", "chunk")]
    p = subprocess.run([sys.executable, str(script), "--device", DEVICE, "--steps", "2", *sizes], capture_output=True,
                       text=True, timeout=a.section_timeout)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    emit(out, "profile", returncode=p.returncode, lines=lines, stderr_tail=p.stderr[-600:] if p.returncode else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    # train early (a timeout cuts the tail), compile last (its compile takes a minute or more)
    ap.add_argument("--sections", default="env,learner,train,padding_free,profile,engine,fsdp2_ws1,logprob_memory,"
                                          "compile")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run at toy sizes")
    for k in SIZES:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None,
                        help=f"default {SIZES[k]} (--device cpu: {DRY[k]})" + (
                            "; tokens (rows x columns) per LM-head chunk (2,048: 8 rows x 256 columns)" if k == "chunk" else ""))
    ap.add_argument("--engine-runs", default=None, help="engine: rows/decode[+noise][:noise threads] runs, in order "
                    f"(default {ENGINE['runs']}; --device cpu: {ENGINE_DRY['runs']})")
    ap.add_argument("--engine-dynamic-tokens", type=int, default=None, help="engine: new tokens of a dynamic arm "
                    f"(default {ENGINE['dynamic_tokens']}; --device cpu: {ENGINE_DRY['dynamic_tokens']})")
    ap.add_argument("--engine-budget", type=float, default=None, help="engine: start no arm after this many "
                    f"seconds (default {ENGINE['budget']}; --device cpu: {ENGINE_DRY['budget']})")
    ap.add_argument("--section-timeout", type=int, default=240)
    ap.add_argument("--work", default="/tmp/gpu_check_work", help="run directories and the base cache (not under --out)")
    a = ap.parse_args()
    a.dry = a.device == "cpu"
    for k, v in (DRY if a.dry else SIZES).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k, v in (ENGINE_DRY if a.dry else ENGINE).items():
        if getattr(a, f"engine_{k}") is None:
            setattr(a, f"engine_{k}", v)
    global DEVICE, LAYERS, VOCAB
    DEVICE, LAYERS, VOCAB = a.device, a.layers, a.vocab
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for name in a.sections.split(","):
        fn = globals()[name]
        fn(out) if name == "env" else fn(out, a)
    print(f"gpu_check done in {time.perf_counter() - t:.0f}s", flush=True)


if __name__ == "__main__":
    main()
