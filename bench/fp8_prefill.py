"""Per-tensor FP8 rollouts: the plain path against prefill-once with reused scales, side by side.

    python bench/fp8_prefill.py [--repeats 5] [--threads 1]
    python bench/fp8_prefill.py --agreement BASE_DIR [--batches 20]

``--agreement`` measures agreement only, on a real base (e.g. a lab base from ``~/.cache/trustbatch/base``,
``chain_sum-*``) with chain_sum prompts (2–3 one-digit terms, as in the lab), ``--batches`` batches of 64
prompts × 8 samples, 8 new tokens: per precision (fp8_e4m3, and float32 for scale), how many batches the
prefill-once path samples bit for bit as the plain path, how many completions differ, and how many tokens'
log-probs differ by more than 1e-6, and by how much at most.

The lab's shapes: a random Llama of the default base's size (hidden 128, 4 layers, 4 heads) with the
project's tokenizer, 64 prompts × 8 samples at temperature 1, under ``rollout.precision=fp8_e4m3``;
``short`` has 18-token prompts and 8 new tokens (chain_sum), ``long`` 23-token prompts and 40 new tokens
(chain_sum_steps). A random model rarely samples EOS, so completions run to the limit: the ``long``
case is the long task's worst length. Repeats are interleaved (plain, once, plain, …) after one untimed
warm-up each (``harness.interleave``); medians are printed, and how far the two paths' samples agree: completions that differ,
and the largest |Δ log-prob| over the completions that agree. The two paths take the same scales up to
float round-off (the last prompt token is computed in a [N, 1] step, not inside the [N, P] forward), and a
round-off change of a layer's input, or of its absmax, can move a value across an FP8 rounding boundary:
so they agree bit for bit on most batches, not on all. One JSON line per case and path (``--agreement``: per
precision) is appended to ``bench/results/fp8_prefill.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from trustbatch.policy import load_policy
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.rollout import SamplingParams, TransformersEngine

sys.path.insert(0, str(Path(__file__).parent))
from harness import interleave, options, record  # noqa: E402

CASES = {"short": (18, 8), "long": (23, 40)}  # prompt tokens, new tokens


def main() -> None:
    ap = options(argparse.ArgumentParser())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--agreement", metavar="BASE_DIR")
    ap.add_argument("--batches", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.agreement:
        record("fp8_prefill", agreement(Path(a.agreement), a.batches), extra={"mode": "agreement", "base": a.agreement},
               save=not a.no_save)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer([f"Compute {x} + {y} = {x + y}" for x in range(40) for y in range(40)], vocab_size=384)
        model = build_small_llama(len(tok), hidden=128, layers=4, heads=4, max_len=128, seed=0, tokenizer=tok)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        policy = load_policy(Path(tmp))
    print(f"threads={a.threads}, repeats={a.repeats} (median), fp8_e4m3, 64 prompts x 8 samples")
    print(f"{'case':<6} {'prompt':>6} {'new':>4} {'plain s':>8} {'once s':>7} {'plain/once':>11}  agreement")
    results = {}
    for name, (plen, new) in CASES.items():
        g = torch.Generator().manual_seed(0)
        prompts = [[tok.bos_token_id] + torch.randint(3, len(tok), (plen - 1,), generator=g).tolist() for _ in range(64)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=new)
        engines = {k: TransformersEngine(policy.model, policy.eos_id, policy.pad_id, precision="fp8_e4m3", prefill_once=k == "once")
                   for k in ("plain", "once")}
        out = {}

        def arm(k):
            out[k] = engines[k].generate(prompts, 8, sp, seeds=list(range(64)))

        times = interleave({k: (lambda k=k: arm(k)) for k in engines}, a.repeats)
        pairs = list(zip(out["plain"], out["once"]))
        differ = sum(x.completion_ids != y.completion_ids for x, y in pairs)
        worst = max((abs(u - v) for x, y in pairs if x.completion_ids == y.completion_ids
                     for u, v in zip(x.behavior_logprobs, y.behavior_logprobs)), default=0.0)
        p, o = statistics.median(times["plain"]), statistics.median(times["once"])
        print(f"{name:<6} {plen:>6} {new:>4} {p:>8.3f} {o:>7.3f} {p / o:>10.2f}x  "
              f"{differ} of {len(pairs)} completions differ, max |Δ log-prob| {worst:.1e}")
        results.update({f"{name}/{k}": {"s": ts, "prompt_tokens": plen, "new_tokens": new, "completions_differ": differ,
                                        "max_abs_logprob_delta": worst} for k, ts in times.items()})
    record("fp8_prefill", results, extra={"mode": "speed", "threads": a.threads, "precision": "fp8_e4m3", "prompts": 64,
                                          "samples": 8}, save=not a.no_save)


def agreement(base: Path, batches: int) -> dict[str, dict]:
    """Per precision: batches sampled bit for bit by both paths, completions that differ, log-probs moved."""
    from trustbatch.data.tasks import load_task

    policy = load_policy(base)
    task = load_task("chain_sum", train_size=64 * batches, heldout_size=8, seed=1,
                     params={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1})
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    results = {}
    for precision in ("fp8_e4m3", "float32"):
        eng = {once: TransformersEngine(policy.model, policy.eos_id, policy.pad_id, precision=precision, prefill_once=once)
               for once in (False, True)}
        exact = differ = tokens = moved = 0
        worst = 0.0
        for b in range(batches):
            prompts = [policy.encode_prompt(e.prompt) for e in task.train[64 * b:64 * b + 64]]
            seeds = [1000 * b + i for i in range(64)]
            plain, once = (eng[k].generate(prompts, 8, sp, seeds=seeds) for k in (False, True))
            d = sum(x.completion_ids != y.completion_ids for x, y in zip(plain, once))
            delta = [abs(u - v) for x, y in zip(plain, once) if x.completion_ids == y.completion_ids
                     for u, v in zip(x.behavior_logprobs, y.behavior_logprobs)]
            differ += d
            tokens += len(delta)
            moved += sum(v > 1e-6 for v in delta)
            worst = max(worst, max(delta, default=0.0))
            exact += d == 0 and max(delta, default=0.0) == 0.0
        print(f"{precision}: {exact} of {batches} batches bit for bit; {differ} of {batches * 512} completions differ; "
              f"{moved} of {tokens} tokens' log-probs differ by > 1e-6, at most {worst:.1e}")
        results[precision] = {"batches": batches, "batches_bit_for_bit": exact, "completions_differ": differ,
                              "completions": batches * 512, "tokens_moved_over_1e-6": moved, "tokens": tokens,
                              "max_abs_logprob_delta": worst}
    return results


if __name__ == "__main__":
    main()
