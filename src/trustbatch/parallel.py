"""Data parallelism: one code path for 1 and N ranks (nanoGPT's rule: world size 1 is the N-rank path with one process).

``World.from_env()`` reads torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``. With one process no
process group is created and every collective is the identity. With N processes the learner's model
is wrapped in ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA) and token counts, ESS
statistics and metrics are summed over ranks.

Normalisation (scale-out.md §5): DDP *averages* gradients over ranks, while every trustbatch loss
divides by the global token count, so each rank's loss is multiplied by the world size; the averaged
gradient then equals the one-process gradient of the whole batch.

``wrap(model, "fsdp2")`` shards the model with ``torch.distributed.fsdp.fully_shard`` (FSDP2): each
decoder block, then the root (torchtune's ``shard_model``). FSDP2 reduce-scatters averaged gradients,
so the same ×world-size rule holds. Under FSDP2 every forward all-gathers a block's weights: every rank
must run the same number of forwards (no-grad ones included), and anything that needs the whole model
(an engine's copy, a checkpoint) gathers it on every rank (``full_tensor``, ``full_model_state``,
``full_optimizer_state``). Tested on CPU with gloo (tests/integration/test_fsdp2.py); FSDP2 on CUDA with NCCL was
not run here.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .processes import die_with_torchrun_agent


# what train.device and `trustbatch eval --device` accept
DEVICE_SPEC = r"auto|cpu|cuda(:\d+)?"


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
        The process group uses NCCL when the ranks train on CUDA, gloo on the CPU. Under torchrun the rank dies
        with its launcher (``processes.die_with_torchrun_agent``), even when it is killed with SIGKILL.

        Raises:
            ValueError: the device cannot be had (``resolve_device``).
            RuntimeError: the process group cannot be initialised (torch.distributed's own message).
        """
        die_with_torchrun_agent()
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

    def random_states(self) -> tuple:
        """This rank's random streams, as a checkpoint keeps them: torch's CPU generator, Python's, and the CUDA
        generator of this rank's device (None on the CPU). Dropout on a GPU draws from the last, so a resume
        without it would drop other units. The CUDA part is untested here: no GPU in CI."""
        device = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), random.getstate(), device

    def set_random_states(self, states: tuple) -> None:
        """Take back ``random_states`` (a checkpoint's before the CUDA part was kept: the CPU streams only)."""
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if len(states) > 2 and states[2] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(states[2], self.device)

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

    def wrap(self, model: torch.nn.Module, strategy: str = "ddp", *,
             param_dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The module to run forward/backward through: ``model`` itself for one rank, else DDP or FSDP2.

        ``strategy="fsdp2"`` shards ``model`` in place (``fully_shard`` per decoder block, then the root)
        and returns it. ``param_dtype`` (FSDP2 only; e.g. ``torch.bfloat16``) computes with weights cast
        to that dtype and reduces gradients in float32, keeping float32 master weights
        (``MixedPrecisionPolicy``); one rank ignores it (use autocast there).

        Raises:
            ValueError: an unknown strategy, or ``param_dtype`` with DDP.
        """
        if strategy not in ("ddp", "fsdp2"):
            raise ValueError(f"unknown data-parallel strategy {strategy!r}; choose 'ddp' or 'fsdp2'")
        if param_dtype is not None and strategy != "fsdp2":
            raise ValueError("param_dtype is FSDP2's mixed precision; with DDP use autocast")
        if self.size == 1:
            return model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
            return DistributedDataParallel(model, device_ids=ids)
        return _fully_shard(model, self.size, param_dtype)

    @staticmethod
    def no_sync(wrapped: torch.nn.Module, skip: bool):
        """Skip the gradient reduction for this backward (all micro-batches but the last): DDP's
        all-reduce, or FSDP2's reduce-scatter (gradients then accumulate unsharded until the last)."""
        if not skip:
            return contextlib.nullcontext()
        if hasattr(wrapped, "set_requires_gradient_sync"):
            return _fsdp2_no_sync(wrapped)
        if hasattr(wrapped, "no_sync"):
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def barrier(self) -> None:
        """Wait for every rank (no-op for one rank)."""
        if self.size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _fsdp2_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of its ``_no_split_modules`` classes (transformers' name for
    the units that must stay whole, e.g. ``LlamaDecoderLayer``), else the children of ``model.model.layers``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not blocks:
        layers = getattr(getattr(model, "model", None), "layers", None)
        blocks = list(layers) if isinstance(layers, torch.nn.ModuleList) else []
    return blocks


def _fully_shard(model: torch.nn.Module, size: int, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """FSDP2 over ``size`` ranks: each block is a unit of its own (its weights are gathered only around
    its forward and backward), the root holds the rest (embeddings, final norm, LM head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(next(model.parameters()).device.type, (size,))
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None
          else MixedPrecisionPolicy())
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor of a DTensor shard (an all-gather: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model_state(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole state dict of an FSDP2 ``model`` (or of a module holding FSDP2 modules, e.g. the ``peft.PeftModel``
    around one) on rank 0, on CPU ({} on other ranks); every rank must call it.

    ``trainable_only``: only the parameters that require grad (LoRA: the adapters; the frozen base is neither
    gathered nor copied). Tied weights (e.g. the LM head and the embedding) stay one tensor under both names, as in
    ``model.state_dict()``, so ``save_pretrained`` writes them as it writes an unsharded model.
    Source: ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` (full_state_dict, cpu_offload,
    ignore_frozen_params).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))
    if full:
        first: dict[int, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            owner = first.setdefault(id(t), name)
            if owner in full:  # not a frozen tensor left out (trainable_only)
                full[name] = full[owner]
    return full


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in its own order (its ``state_dict`` indices): with LoRA only the
    adapters, which are not the first of ``model.named_parameters()``."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state of an FSDP2 ``model`` on rank 0 ({} on other ranks) in ``Optimizer.state_dict()``'s
    own format (state keyed by the index of the parameter in the optimizer's ``param_groups``), so that one
    process loads it with ``optimizer.load_state_dict``; every rank must call it.

    An optimizer that has not stepped yet is saved as it is (no state, its groups): torch's getter would first
    run a step with zero gradients (``_init_optim_state``), which leaves the weights but counts a step in
    AdamW's ``step``, so that the first real update would take the second step's bias corrections.

    Source: ``get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))`` keys
    by parameter name; the names map to the optimizer's indices (``_optimizer_names``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not optimizer.state:  # the same on every rank: all step together
        return optimizer.state_dict() if dist.get_rank() == 0 else {}
    full = get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    index = {name: i for i, name in enumerate(_optimizer_names(model, optimizer))}
    return {"state": {index[k]: v for k, v in full["state"].items()},
            "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in full["param_groups"]]}


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load ``Optimizer.state_dict()``-format ``state`` (whole tensors, the same on every rank) into the
    optimizer of an FSDP2 ``model``, each rank keeping its shard; every rank must call it.

    A state without moments (saved before the first step) is loaded as it is, since torch's setter would first
    step with zero gradients (see ``full_optimizer_state``) and keep the ``step`` that counts. The groups'
    settings are the saved ones, as ``Optimizer.load_state_dict`` gives them.

    Raises:
        KeyError / ValueError: ``state`` is not for this model's parameters (torch's message).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state["state"]:
        optimizer.load_state_dict(state)
        return
    names = _optimizer_names(model, optimizer)
    by_name = {"state": {names[i]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    # torch's setter turns tuples (AdamW's betas) into lists; the saved groups keep them as they were
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
