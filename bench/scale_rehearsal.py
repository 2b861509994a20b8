"""Scale rehearsal: real `trustbatch train` rounds on a Qwen2.5-0.5B-shaped model, memory and time per arm.

    python bench/scale_rehearsal.py [--arms defaults,scaled,float32_full,lora] [--rounds 2] [--new-tokens 128]
                                    [--device cpu] [--workdir /tmp/tb-scale]

The model is random-initialised from a local ``Qwen2Config`` shaped like Qwen2.5-0.5B (hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4,864, V = 151,936, tied embeddings; 494M parameters) with a small BPE
tokenizer trained here (the model's vocabulary exceeds the tokenizer's, as Qwen's does), saved once as an HF
directory and loaded by ``model.path`` like any user's model. Each arm is one fresh ``trustbatch train`` process
(2 prompts × 4 samples per round, ``--new-tokens`` new tokens, a reward with spread: the share of digits in the
completion), whose peak RSS it reports with the rollout's seconds and the whole round's (``step_s``: rollout, learner and
weight sync) and tokens/s from the run's own metrics. Arms:

- ``defaults``: nothing but the model and the round's shape set: float32, no checkpointing, the default micro-batch
  (512 rows) and LM-head chunk (``auto``: 441 tokens at this V), the default evaluation and checkpoints
  (``tests/integration/test_scale_rehearsal.py`` runs this arm's command for one round);
- ``scaled``: bf16-mixed, activation checkpointing, micro-batches of 8, the default chunk (results before the chunk
  counted tokens set 64 completion columns);
- ``float32_full``: float32, no checkpointing, micro-batches of 8, the full-vocabulary logits path;
- ``lora``: ``scaled`` plus LoRA r = 16 on every linear layer.

Each process gets an address-space limit (``--mem-limit-gib``, default 22) so an arm that does not fit ends with an
allocation error instead of the machine's OOM killer; the line then says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import options, record  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=2048,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)

_SMALL_RUN = ["eval.every=1000", "eval.samples_per_prompt=1", "checkpoint_every=1000", "train.micro_batch_size=8",
              "train.warmup_steps=0"]
ARMS = {
    "defaults": [],
    "scaled": _SMALL_RUN + ["train.precision=bf16-mixed", "train.activation_checkpointing=true"],
    "float32_full": _SMALL_RUN + ["train.precision=float32", "train.activation_checkpointing=false",
                                  "train.logprob_chunk_size=null"],
    "lora": _SMALL_RUN + ["train.precision=bf16-mixed", "train.activation_checkpointing=true", "model.lora.r=16",
                          "model.lora.alpha=32", "train.lr=1e-4"],
}


def overrides(arm: str, model_dir: Path, run_dir: Path, *, new_tokens: int, rounds: int, threads: int = 0,
              device: str = "cpu") -> list[str]:
    """The ``trustbatch train`` overrides of one arm: the model, 2 prompts × 4 samples × ``new_tokens`` per round
    for ``rounds`` rounds, two held-out prompts, an in-process reward with spread, then the arm's own settings."""
    return [f"model.path={model_dir}", "task.name=chain_sum", "task.train_size=64", "task.heldout_size=2",
            "rollout.prompts_per_step=2", "rollout.group_size=4", f"rollout.max_new_tokens={new_tokens}",
            f"train.steps={rounds}", "reward.name=scale_rehearsal:score", "reward.workers=0",
            f"train.device={device}", f"threads={threads}", f"run_dir={run_dir}"] + ARMS[arm]


def score(completion: str, reference: str) -> float:
    """The share of digits among the completion's non-space characters: a reward with spread for a random model."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def build_model_dir(path: Path, layers: int = 24, seed: int = 0) -> Path:
    """Save a random-initialised Qwen2.5-0.5B-shaped model (float32) and a small local tokenizer to ``path``."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trustbatch.data import load_task
    from trustbatch.policy.tokenizer import train_tokenizer

    task = load_task("chain_sum", train_size=256, heldout_size=16, seed=1)
    tok = train_tokenizer([e.prompt for e in task.train] + [e.reference for e in task.train], vocab_size=384)
    cfg = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers}, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    # A random model samples uniformly over 151,936 ids, of which the tokenizer decodes 384: every completion would
    # decode to nothing and the reward would have no spread. The embedding rows beyond the tokenizer are scaled down
    # (tied: the LM head too), so that the model samples mostly decodable tokens, as a trained model would.
    # With tied embeddings a random model also echoes its last input token (its embedding dominates the residual
    # stream, and h·e is largest for that same e); random signs on the final norm's weights remove the echo.
    with torch.no_grad():
        model.get_input_embeddings().weight[len(tok):] *= 0.0
        model.get_input_embeddings().weight[:len(tok)] *= 6.0
        norm = model.model.norm.weight
        norm.copy_(torch.randint(0, 2, norm.shape, generator=torch.Generator().manual_seed(seed)) * 2.0 - 1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Runs `trustbatch train` in this process and writes its peak RSS at exit, whatever the exit (sys.exit included).
_CHILD = """
import atexit, json, resource, sys
limit, rss_path = int(sys.argv[1]), sys.argv[2]
if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
atexit.register(lambda: open(rss_path, "w").write(json.dumps(
    {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})))
sys.argv = ["trustbatch", "train"] + sys.argv[3:]
from trustbatch.cli import main
main()
"""


def run_arm(name: str, model_dir: Path, workdir: Path, a) -> dict:
    run_dir = workdir / f"run-{name}-{int(time.time())}"
    args = overrides(name, model_dir, run_dir, new_tokens=a.new_tokens, rounds=a.rounds, threads=a.threads,
                     device=a.device)
    rss_file = workdir / f"rss-{name}.json"
    rss_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    limit = int(a.mem_limit_gib * 2**30) if a.device == "cpu" else 0  # CUDA reserves huge virtual ranges
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(limit), str(rss_file)] + args, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    out: dict = {"overrides": ARMS[name], "returncode": proc.returncode, "wall_s": round(wall, 1)}
    if rss_file.exists():
        out.update(json.loads(rss_file.read_text()))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        out["error"] = " | ".join(tail)
        return out
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in recs if r.get("step", 0) > 0 and "step_s" in r]
    for k in ("rollout_s", "step_s", "tokens_per_s", "response_length", "reward_mean", "ess"):
        vals = [r[k] for r in rounds if k in r]
        if vals:
            out[k] = vals
    return out


def main() -> None:
    ap = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--arms", default="defaults,scaled,float32_full,lora")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--mem-limit-gib", type=float, default=22.0)
    ap.add_argument("--workdir", default="/tmp/tb-scale")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    t = time.perf_counter()
    model_dir = build_model_dir(workdir / f"qwen25-05b-shaped-{a.layers}l", layers=a.layers)
    print(f"model directory {model_dir} ready in {time.perf_counter() - t:.0f}s", flush=True)
    arms = {name: run_arm(name, model_dir, workdir, a) for name in a.arms.split(",")}
    record("scale_rehearsal", arms, extra={"model": "Qwen2.5-0.5B-shaped, random init", "layers": a.layers,
                                           "prompts": 2, "samples": 4, "new_tokens": a.new_tokens,
                                           "rounds": a.rounds, "device": a.device}, save=not a.no_save)


if __name__ == "__main__":
    main()
