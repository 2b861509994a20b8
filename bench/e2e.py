"""Seconds per optimizer step of the default job, split into generation, scoring and learner, with each optimization off in turn.

    python bench/e2e.py [--threads 2] [--repeats 5] [--warmup 1] [--arms all,none,...]   # the default job
    python bench/e2e.py --tiny --repeats 1                                  # tests/support/tiny.py's config: a smoke run
    python bench/e2e.py --scale [--threads 2] [--repeats 3]                # ~50M-parameter random Llama,
                                                                            # prompt 128 / completion 512, learner only

Default job: ``load_config(None, [])`` (64 prompts × 8 completions per optimizer step, the cached
default base, built on first use in ~1 min under $TRUSTBATCH_CACHE or ~/.cache/trustbatch). One
policy trains in place; each round runs one arm, and the arms take turns (every round of arms
starts at the next one), so machine noise and the policy's drift hit all alike. Arms (``ARMS``):
``all`` (every optimization on, the default code), ``-shared`` (the learner's plain forward instead of
the shared-prompt forward), ``-prefill`` (the engine prefills every row's prompt), ``-chunks`` (the
reward pool sends one message per completion), ``-trim`` (learner micro-batches at the batch's
widths; the default job has one micro-batch, so this arm measures nothing there), ``none`` (all
off: the code before issue 13) and ``+packed`` (everything on, and the learner's padding-free forward,
``train.padding_free``). Each round is timed as generation (engine.generate), scoring
(reward pool), learner (``train_on``) and the rest (batching, advantages, weight sync). Medians over
``--repeats`` rounds per arm; the 1-minute load average is printed next to each figure (other
processes on the machine distort timings), and process CPU time beside wall time. Rounds are run by
``harness.interleave`` (``rotate``); one JSON line per arm goes to ``bench/results/e2e.jsonl``.

Useful FLOP/s: the FLOPs a step needs once each distinct prompt and each completion token is
computed once (no padding, no prompt copies): per token 2·(linear weights) + 4·layers·hidden·context
for attention, the LM head only where a log-prob is needed; ×3 for the learner's forward + backward;
generation counts its prefill and every sampled token. Divided by the step's (or learner's) time and by
a float32 matmul peak measured here on the same threads (best 1024² matmul seen, measured before
every round: a busy machine lowers it, so the best is the closest to the machine's peak).

``--scale``: a randomly initialised Llama (hidden 640, 8 layers, 10 heads, vocabulary 8192: ~48M
parameters), one group of G=8 completions of 512 tokens on a 128-token prompt, one forward +
backward of Σ log-probs per repeat, off and on interleaved.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from trustbatch.policy.forward import pack, response_logprobs, trimmed
from trustbatch.policy.packed import packed_response_logprobs
from trustbatch.policy.shared_prompt import grouped_response_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """Best float32 matmul FLOP/s over ``repeats`` n×n @ n×n products (2n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def model_shape(model) -> tuple[int, int, int, int]:
    """(linear weights in the decoder layers, hidden, layers, vocabulary) of a Llama-like causal LM."""
    cfg = model.config
    linear = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    return linear, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size


def forward_flops(shape, prompts: list[list[int]], completions: list[list[int]], group: int) -> tuple[float, float]:
    """(learner forward FLOPs, generation FLOPs) of one batch, each distinct prompt counted once.

    prompts/completions: per row; rows come in groups of ``group`` sharing a prompt.
    """
    linear, h, layers, vocab = shape
    learn = gen = 0.0
    for i in range(0, len(prompts), group):
        p = len(prompts[i])
        pre = sum(2 * linear + 4 * layers * h * (t + 1) for t in range(p))  # the prompt once
        learn += pre
        gen += pre + 2 * h * vocab  # prefill, and the first token's logits
        for c in completions[i:i + group]:
            for t in range(len(c)):
                tok = 2 * linear + 4 * layers * h * (p + t + 1)
                learn += tok + 2 * h * vocab
                gen += (tok + 2 * h * vocab) if t < len(c) - 1 else 0.0  # the last token is not fed back
    return learn, gen


class Timed:
    """Wraps ``obj.name`` (an instance attribute) to add its wall time to ``self.s``."""

    def __init__(self, obj, name: str):
        self.s = 0.0
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s += time.perf_counter() - t

        setattr(obj, name, wrapper)


# Each optimization of issue 13 as a switch; an arm turns some off. "none" is the code before them.
OPTIMIZATIONS = ("shared", "prefill", "chunks", "trim")
ARMS = {
    "all": (),
    "-shared": ("shared",),  # learner: plain forward (each prompt once per completion)
    "-prefill": ("prefill",),  # generation: every row's prompt prefilled
    "-chunks": ("chunks",),  # reward pool: one message per completion
    "-trim": ("trim",),  # learner: micro-batches at the batch's widths
    "none": OPTIMIZATIONS,
    "+packed": ("+packed",),  # learner: padding-free micro-batches (train.padding_free), every other optimization on
}


def apply_arm(arm: str, source, learner, chunk_size: int) -> None:
    """Switch the optimizations on the live parts; the arm's switches off, every other on."""
    off = set(ARMS[arm])
    fn = response_logprobs if "shared" in off else grouped_response_logprobs
    learner.forward_fn = fn if "trim" in off else trimmed(fn)
    if "+packed" in off:
        learner.forward_fn = functools.partial(packed_response_logprobs, chunk_size=learner.logprob_chunk_size)
    source.engine.prefill_once = "prefill" not in off
    source.pool.chunk_size = 1 if "chunks" in off else chunk_size


def default_job(a) -> None:
    from trustbatch.config import load_config
    from trustbatch.recipes.build import build_parts, prepare_run

    overrides = []
    if a.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
        from tiny import TINY

        overrides = TINY
    cfg = load_config(None, overrides)
    task, policy, pool, src = prepare_run(cfg)
    built = build_parts(cfg, task, policy, pool)
    source, learner, sync = built.parts.source, built.parts.learner, built.parts.sync
    gen_t, score_t = Timed(source.engine, "generate"), Timed(source.pool, "score")
    shape = model_shape(policy.model)
    G = cfg.rollout.group_size
    chunk_size = source.pool.chunk_size
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    peak = matmul_peak()
    print(f"{'tiny' if a.tiny else 'default'} job: {cfg.rollout.prompts_per_step} prompts × {G} completions, base {src}, "
          f"{sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M parameters, {a.threads} threads")
    print(f"float32 matmul peak {peak / 1e9:.1f} GFLOP/s ({load()})")
    print("arms: " + "; ".join(f"{k}: " + ("all on" if not v else "off " + ", ".join(v)) for k, v in ARMS.items()
                              if k in arms))
    rows: dict[str, list[dict]] = {k: [] for k in arms}
    last: dict = {"calls": 0}

    def one_round(name: str) -> float:
        nonlocal peak
        r = last["calls"] // len(arms)
        last["calls"] += 1
        apply_arm(name, source, learner, chunk_size)
        peak = max(peak, matmul_peak())  # the best seen: a busy machine only lowers it
        gen_t.s = score_t.s = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        batch = last["batch"] = source.next_batch(learner.version)
        t1 = time.perf_counter()
        c1 = time.process_time()
        learner.train_on(batch)
        t2, c2 = time.perf_counter(), time.process_time()
        sync.push(learner.model, learner.version)
        source.on_update({})
        t3, c3 = time.perf_counter(), time.process_time()
        m = batch.packed.response_mask
        ids, lens = batch.packed.input_ids, batch.packed.attention_mask.sum(1)
        n = m.sum(1)
        prompts = [ids[i, ids.shape[1] - int(lens[i]):ids.shape[1] - int(n[i])].tolist() for i in range(len(batch))]
        comps = [[0] * int(k) for k in n]
        learn_f, gen_f = forward_flops(shape, prompts, comps, G)
        row = dict(step=t3 - t0, gen=gen_t.s, score=score_t.s, learner=t2 - t1, other=(t3 - t0) - gen_t.s
                   - score_t.s - (t2 - t1), tokens=float(m.sum()), useful=3 * learn_f + gen_f,
                   useful_learner=3 * learn_f, load=os.getloadavg()[0], step_cpu=c3 - c0, learner_cpu=c2 - c1)
        rows[name].append(row)
        print(f"  round {r:2d} {name:>8}: step {row['step']:.3f} s (process CPU {row['step_cpu']:.3f} s)  gen "
              f"{row['gen']:.3f} s  score {row['score']:.3f} s  learner {row['learner']:.3f} s  ({load()})", flush=True)
        return row["step"]

    # each round starts at another arm
    interleave({name: (lambda name=name: one_round(name)) for name in arms}, a.repeats, warmup=a.warmup, rotate=True)
    rows = {k: v[a.warmup:] for k, v in rows.items()}
    batch = last["batch"]
    pool.close()
    same = same_batch(learner.model, batch, a)
    print(f"\nmedian of {a.repeats} rounds per arm, arms interleaved (each round starts at the next arm); "
          f"best matmul peak seen {peak / 1e9:.1f} GFLOP/s")
    print(f"{'arm':>8}{'step s':>9}{'gen s':>8}{'score s':>9}{'learner s':>11}{'other s':>9}{'tok/s':>9}"
          f"{'useful/peak':>13}{'learner useful/peak':>21}{'load':>7}{'step CPU s':>12}{'learner CPU s':>15}")
    med = {}
    for name, rs in rows.items():
        md = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        med[name] = md
        useful = statistics.median(x["useful"] / x["step"] for x in rs)
        useful_l = statistics.median(x["useful_learner"] / x["learner"] for x in rs)
        print(f"{name:>8}{md['step']:>9.3f}{md['gen']:>8.3f}{md['score']:>9.3f}{md['learner']:>11.3f}"
              f"{md['other']:>9.3f}{md['tokens'] / md['step']:>9.0f}{useful / peak:>13.1%}{useful_l / peak:>21.1%}"
              f"{md['load']:>7.2f}{md['step_cpu']:>12.3f}{md['learner_cpu']:>15.3f}")
    base = "none" if "none" in med else arms[0]
    for name in arms:
        if name != base:
            print(f"{name}/{base}: step {med[name]['step'] / med[base]['step']:.2f}× (CPU "
                  f"{med[name]['step_cpu'] / med[base]['step_cpu']:.2f}×), gen {med[name]['gen'] / med[base]['gen']:.2f}×, "
                  f"score {med[name]['score'] / max(med[base]['score'], 1e-9):.2f}×, "
                  f"learner {med[name]['learner'] / med[base]['learner']:.2f}×")
    print(f"learner forward+backward on one batch ({len(batch)} rows), median of {a.repeats}, interleaved, "
          "shared-prompt forward off vs on:")
    for name, (wall, cpu, ld) in same.items():
        print(f"{name:>4}: {wall:.3f} s (CPU {cpu:.3f} s)  load {ld:.2f}")
    print(f"on/off: {same['on'][0] / same['off'][0]:.2f}× (CPU {same['on'][1] / same['off'][1]:.2f}×)")
    fields = ("step", "gen", "score", "learner", "other", "tokens", "load", "step_cpu", "learner_cpu")
    arms_out = {name: {**{f"{k}_s" if k not in ("tokens", "load") else k: [x[k] for x in rs] for k in fields},
                       "useful_per_peak": statistics.median(x["useful"] / x["step"] for x in rs) / peak,
                       "learner_useful_per_peak": statistics.median(x["useful_learner"] / x["learner"] for x in rs) / peak}
                for name, rs in rows.items()}
    arms_out.update({f"same_batch/{k}": {"s": wall, "cpu_s": cpu, "load": ld} for k, (wall, cpu, ld) in same.items()})
    record("e2e", arms_out, extra={"job": "tiny" if a.tiny else "default", "prompts": cfg.rollout.prompts_per_step,
                                   "group": G, "threads": a.threads, "matmul_peak_gflops": peak / 1e9},
           save=not a.no_save)


def same_batch(model, batch, a) -> dict[str, tuple[float, float, float]]:
    """Median (wall s, process CPU s, load) of forward + backward of Σ log-probs over ``batch``, off vs on."""
    packed, mask = batch.packed, batch.packed.response_mask
    fns = {"off": response_logprobs, "on": grouped_response_logprobs}
    res: dict[str, list] = {k: [] for k in fns}

    def arm(name: str) -> float:
        model.zero_grad(set_to_none=True)
        c, t = time.process_time(), time.perf_counter()
        logp, _ = fns[name](model, packed, with_entropy=True)
        (logp * mask).sum().backward()
        res[name].append((time.perf_counter() - t, time.process_time() - c, os.getloadavg()[0]))
        return res[name][-1][0]

    interleave({k: (lambda k=k: arm(k)) for k in fns}, a.repeats, warmup=a.warmup, rotate=True)
    res = {k: v[a.warmup:] for k, v in res.items()}
    model.zero_grad(set_to_none=True)
    return {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in res.items()}


def scale_model():
    """The ``--scale`` shape: a random Llama, hidden 640, 8 layers, 10 heads, vocabulary 8192 (~48M), in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=640, intermediate_size=1920, num_hidden_layers=8,
                      num_attention_heads=10, num_key_value_heads=10, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).train()


def scale_job(a) -> None:
    model = scale_model()
    g = torch.Generator().manual_seed(1)
    P, C, G = a.prompt, a.completion, a.group
    prompt = torch.randint(3, 8192, (P,), generator=g).tolist()
    comps = [torch.randint(3, 8192, (C,), generator=g).tolist() for _ in range(G)]
    packed = pack([prompt] * G, comps, pad_id=0)
    learn_f, _ = forward_flops(model_shape(model), [prompt] * G, comps, G)
    peak = matmul_peak()
    print(f"scale: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter random Llama, prompt {P}, "
          f"{G} completions of {C} tokens, float32, {a.threads} threads; matmul peak {peak / 1e9:.1f} GFLOP/s ({load()})")
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    fns = {"off": response_logprobs, "on": lambda m, p: grouped_response_logprobs(m, p, min_saving=0.0)}

    def arm(name: str) -> float:
        nonlocal peak
        model.zero_grad(set_to_none=True)
        peak = max(peak, matmul_peak())
        c, t = time.process_time(), time.perf_counter()
        logp, _ = fns[name](model, packed)
        (logp * packed.response_mask).sum().backward()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        cpu[name].append(dc)
        print(f"  repeat {len(cpu[name]) - 1} {name:>3}: forward+backward {dt:.2f} s (process CPU {dc:.2f} s)  "
              f"({load()})", flush=True)
        return dt

    times = interleave({k: (lambda k=k: arm(k)) for k in fns}, a.repeats, warmup=a.warmup, rotate=True)
    cpu = {k: v[a.warmup:] for k, v in cpu.items()}
    print(f"best matmul peak seen {peak / 1e9:.1f} GFLOP/s")
    for name, ts in times.items():
        md = statistics.median(ts)
        print(f"{name:>4}: {md:.2f} s (CPU {statistics.median(cpu[name]):.2f} s)  useful {3 * learn_f / md / peak:.1%} of peak")
    print(f"on/off: {statistics.median(times['on']) / statistics.median(times['off']):.2f}× "
          f"(CPU {statistics.median(cpu['on']) / statistics.median(cpu['off']):.2f}×)")
    record("e2e", {f"scale/{k}": {"s": ts, "cpu_s": cpu[k], "useful_per_peak": 3 * learn_f / statistics.median(ts) / peak}
                   for k, ts in times.items()},
           extra={"job": "scale", "prompt": P, "completion": C, "group": G, "threads": a.threads,
                  "matmul_peak_gflops": peak / 1e9}, save=not a.no_save)


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="measured rounds per variant (default 5; --scale 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--scale", action="store_true", help="the ~50M-parameter prompt 128 / completion 512 case")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"comma-separated arms of the default job, from {', '.join(ARMS)} (default: all of them)")
    ap.add_argument("--tiny", action="store_true", help="tests/support/tiny.py's config: checks the script runs, times nothing useful")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--group", type=int, default=8)
    a = ap.parse_args()
    a.repeats = a.repeats or (3 if a.scale else 5)
    torch.set_num_threads(a.threads)
    scale_job(a) if a.scale else default_job(a)


if __name__ == "__main__":
    main()
