"""Write reasoning-gym chain_sum prompts as a GSM8K-format JSONL file ({"question", "answer": "… #### N"}).

A GSM8K-format dataset that the default small model can learn, to see the file + gsm8k-reward
path improve held-out accuracy on a CPU:

    python examples/chain_sum_as_gsm8k.py /tmp/chain_sum_gsm8k.jsonl
    trustbatch train data=/tmp/chain_sum_gsm8k.jsonl reward.name=gsm8k
"""

import json
import sys

import reasoning_gym

from trustbatch.data.tasks import DEFAULT_PARAMS

out = sys.argv[1] if len(sys.argv) > 1 else "chain_sum_gsm8k.jsonl"
ds = reasoning_gym.create_dataset("chain_sum", size=6000, seed=1, **DEFAULT_PARAMS["chain_sum"])
with open(out, "w") as f:
    for e in ds:
        f.write(json.dumps({"question": e["question"], "answer": f"#### {e['answer']}"}) + "\n")
print(f"wrote {len(ds)} rows to {out}")
