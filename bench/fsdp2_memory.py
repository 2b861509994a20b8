"""Per-rank learner memory under DDP and FSDP2: two gloo ranks on CPU, one optimizer step each.

Prints, per strategy, the bytes each rank holds in weights, gradients and AdamW state after one step
(counted from the local tensors: a DTensor counts its shard; the gradients, freed by the step's zero_grad,
have the weights' sizes under both strategies) and the rank's peak RSS (a fresh pair of
processes per strategy; RSS includes torch itself and DDP's gradient buckets, and is noisy).

    python bench/fsdp2_memory.py --hidden 256 --layers 4 --vocab 8192
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def _rank(rank: int, strategy: str, args, out_dir: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(180, exit=True)  # a hung collective ends the bench instead of waiting
    from transformers import LlamaConfig, LlamaForCausalLM

    from trustbatch.pipeline.batch import TrainBatch
    from trustbatch.policy.forward import pack
    from trustbatch.trainer.learner import Learner
    from trustbatch.parallel import World

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"file://{out_dir}/init-{strategy}", rank=rank,
                                         world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    world = World.from_env()
    learner = Learner(model, "p3o", {}, micro_batch_size=4, world=world, strategy=strategy)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, args.vocab, (16,), generator=g).tolist() for _ in range(8)]
    comps = [torch.randint(3, args.vocab, (16,), generator=g).tolist() for _ in range(8)]
    packed = pack(prompts, comps, pad_id=0)
    batch = TrainBatch(packed, torch.full((8, 16), -3.0), torch.randn(8, generator=g), torch.zeros(8, dtype=torch.long))
    learner.step(batch.select(world.shard(len(batch))))
    params = list(model.parameters())
    state = [v for p in params for v in learner.optimizer.state[p].values() if v.dim() > 0]
    row = {"weights": _local_bytes(params),
           "adam": _local_bytes(state), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    torch.save(row, Path(out_dir) / f"{strategy}-{rank}.pt")
    torch.distributed.destroy_process_group()
    from trustbatch.processes import exit_without_finalizing

    exit_without_finalizing(0)  # gloo's threads would abort a finalising rank now and then (pytorch#190489)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for strategy in ("ddp", "fsdp2"):
            mp.start_processes(_rank, args=(strategy, args, d), nprocs=2, start_method="spawn", join=True)
            for r in range(2):
                row = torch.load(Path(d) / f"{strategy}-{r}.pt")
                print(f"{strategy:6s} rank {r}: " + "  ".join(f"{k} {v / 2**20:8.1f} MiB" for k, v in row.items()))


if __name__ == "__main__":
    main()
