"""P3O inside TRL's GRPOTrainer, on a local Hugging Face model directory and a local dataset (CPU is fine).

    pip install 'trustbatch[trl]'
    python examples/trl_p3o.py --model ../shared/models/stories260K-hf --steps 3
    python examples/trl_p3o.py --model DIR --data prompts.jsonl --objective grpo --options '{"eps_high": 0.28}'

``--data`` is a JSONL file with a "prompt" field per line; without it a few story openings are used.
The toy reward prefers completions near 12 words that avoid the letter "z": swap in your own.
Each generation batch is trained on twice (num_iterations=2), so the second pass is off-policy and
the logged ESS drops below 1.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from trustbatch.adapters.trl import TrustbatchGRPOTrainer

PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named Lily", "Tom and his mom",
           "In the park", "The big red ball", "A cat sat", "The sun was"]


def length_reward(completions, **_):
    """1 at 12 words, falling off linearly; 0 if the completion holds a 'z'."""
    return [0.0 if "z" in c else max(0.0, 1.0 - abs(len(c.split()) - 12) / 12) for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local HF model directory")
    ap.add_argument("--data", help="JSONL with a 'prompt' field per line")
    ap.add_argument("--objective", default="p3o")
    ap.add_argument("--options", default="{}", help="objective options as JSON")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    a = ap.parse_args()

    if a.data:
        with open(a.data, encoding="utf-8") as f:
            rows = [{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()]
    else:
        rows = [{"prompt": p} for p in PROMPTS]
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model)
    out = a.out or tempfile.mkdtemp(prefix="trl_p3o_")
    args = GRPOConfig(output_dir=out, max_steps=a.steps, per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, max_completion_length=24, learning_rate=1e-3,
                      num_iterations=2,  # each generation trains twice: the second pass is off-policy
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, beta=0.0)
    trainer = TrustbatchGRPOTrainer(model=model, processing_class=tok, reward_funcs=length_reward, args=args,
                                    train_dataset=Dataset.from_list(rows), objective=a.objective,
                                    objective_options=json.loads(a.options))
    trainer.train()
    for rec in trainer.state.log_history:
        if "trustbatch/ess" in rec:
            reward = f"{rec['reward']:.3f}" if "reward" in rec else "(reused batch)"
            print(f"step {rec['step']}: reward {reward}  ess {rec['trustbatch/ess']:.4f}  "
                  f"kl_weight {rec.get('trustbatch/kl_weight', 0.0):.4f}")
    print("outputs in", os.path.abspath(out))


if __name__ == "__main__":
    main()
