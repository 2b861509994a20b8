"""Data parallelism: one code path for 1 and N ranks (nanoGPT's rule: world size 1 is the N-rank path with one process).

``World.from_env()`` reads torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``. With one process no
process group is created and every collective is the identity. With N processes the learner's model
is wrapped in ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA) and token counts, ESS
statistics and metrics are summed over ranks.

Normalisation (scale-out.md §5): DDP *averages* gradients over ranks, while every trustbatch loss
divides by the global token count, so each rank's loss is multiplied by the world size; the averaged
gradient then equals the one-process gradient of the whole batch.

``wrap(model, "fsdp2")`` uses ``torch.distributed.fsdp.fully_shard``: untested here (no GPU lent to
this work); DDP on gloo is what the tests run.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def resolve_device(spec: str = "auto", local_rank: int = 0) -> torch.device:
    """The torch device that ``train.device`` names for the rank with ``local_rank`` on its node.

    ``auto``: ``cuda:<local_rank>`` when CUDA is available, else ``cpu``. ``cuda``: ``cuda:<local_rank>``
    (one rank = one GPU under torchrun). ``cuda:N``: that GPU, whatever the rank. ``cpu``: the CPU.

    Raises:
        ValueError: CUDA is asked for but not available, or ``cuda:N`` names a GPU this machine lacks.
    """
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"train.device={spec} but torch sees no CUDA device (torch {torch.__version__}); "
                         "use train.device=cpu or auto, or install a CUDA build of torch")
    index = local_rank if spec in ("auto", "cuda") else int(spec.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ValueError(f"train.device={spec} needs GPU {index}, but this machine has {torch.cuda.device_count()}; "
                         "run one rank per GPU (torchrun --nproc-per-node <= GPUs) or name another device")
    return torch.device("cuda", index)


@dataclass
class World:
    """This process's place among the data-parallel ranks, and the device it trains on."""

    rank: int = 0
    size: int = 1
    owns_group: bool = False  # we created the process group, so we destroy it
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_env(cls, device: str = "cpu") -> "World":
        """The world torchrun describes in the environment, initialising the process group if needed.

        ``device`` is ``train.device`` (``resolve_device``; each rank takes its ``LOCAL_RANK``'s GPU).
        The process group uses NCCL when the ranks train on CUDA, gloo on the CPU.

        Raises:
            ValueError: the device cannot be had (``resolve_device``).
            RuntimeError: the process group cannot be initialised (torch.distributed's own message).
        """
        size = int(os.environ.get("WORLD_SIZE", "1"))
        dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if size <= 1:
            return cls(device=dev)
        owns = False
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
            owns = True
        return cls(rank=dist.get_rank(), size=dist.get_world_size(), owns_group=owns, device=dev)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def _collective_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo takes CPU tensors
        return self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks, in float64 (identity for one rank)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks (identity for one rank)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (the first ``n % size`` ranks get one more)."""
        return self.shard_of(n, self.rank)

    def shard_of(self, n: int, rank: int) -> slice:
        """Rank ``rank``'s contiguous share of ``n`` items."""
        base, extra = divmod(n, self.size)
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (rank < extra))

    def wrap(self, model: torch.nn.Module, strategy: str = "ddp") -> torch.nn.Module:
        """The module to run forward/backward through: ``model`` itself for one rank, else DDP or FSDP2.

        Raises:
            ValueError: an unknown strategy.
        """
        if self.size == 1:
            return model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
            return DistributedDataParallel(model, device_ids=ids)
        if strategy == "fsdp2":  # untested: needs GPUs
            from torch.distributed.fsdp import fully_shard

            return fully_shard(model)
        raise ValueError(f"unknown data-parallel strategy {strategy!r}; choose 'ddp' or 'fsdp2'")

    @staticmethod
    def no_sync(wrapped: torch.nn.Module, skip: bool):
        """Skip DDP's gradient all-reduce for this backward (all micro-batches but the last)."""
        if skip and hasattr(wrapped, "no_sync"):
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def barrier(self) -> None:
        """Wait for every rank (no-op for one rank)."""
        if self.size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
