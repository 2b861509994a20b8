"""LoRA adapters (peft) on a policy: only the adapters train; engines, exports and evaluation see the merged policy.

A LoRA layer computes ``h = W x + (α/r) · B A x`` with the base weight ``W`` [out, in] frozen and the adapter
``A`` [r, in], ``B`` [out, r] trained (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685, Eq. 3; peft's ``LoraConfig(r, lora_alpha)``, scaling ``lora_alpha / r``). peft initialises
``B = 0``, so the policy starts as the base.

``apply_lora`` injects the adapters into ``policy.model`` in place (``peft.get_peft_model``): the module stays the
transformers model the learner, the shared-prompt forward and ``generate`` already run, with each targeted
``Linear`` replaced by peft's LoRA layer. What leaves the learner is the merged policy under the base model's
parameter names: ``merged_weights`` gives ``W + (α/r)·B·A`` (peft's ``get_delta_weight``) for every adapted
layer and the base tensor for the rest, with no ``lora_A``/``lora_B`` keys and no ``base_layer`` in the names,
so a rollout engine holding its own copy (another precision, a lag, vLLM, a worker process) loads it as it
loads a full fine-tuning state. A checkpoint stores the adapter (``adapter_config.json``,
``adapter_model.safetensors``: peft's ``save_pretrained``) and names its base in ``base_model_name_or_path``;
``load_merged`` reads such a directory back as a plain merged model (export).

Under FSDP2 (``parallel.World.wrap(..., "fsdp2")``) the adapters are sharded with their base layers; the merge
runs on the shards and gathers whole tensors, and a checkpoint writes the adapters' whole tensors gathered by the
caller (``save_adapter``'s ``state_dict``): the same files as an unsharded run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Iterator

import torch

from ..errors import UserError
from ..seeding import forked_rngs
from ..parallel import full_tensor

# ``Policy`` in the annotations is ``policy.model.Policy``, not imported here: model.py imports this module lazily
# (LoRA checkpoints, merged saves), and the floors allow no cycle.

ADAPTER_CONFIG = "adapter_config.json"  # peft's file names, which peft's own loaders expect
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    if "peft" not in sys.modules:  # no adapter can exist, and full fine-tuning never pays peft's import
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    """Whether peft LoRA layers are injected into ``model``."""
    return bool(_lora_layers(model))


def apply_lora(policy: Policy, *, r: int, alpha: float, dropout: float, target_modules, base: str,
               seed: int = 0) -> None:
    """Inject LoRA adapters into ``policy.model`` in place and freeze every base weight.

    Args:
        r: adapter rank. alpha: the scaling numerator (update ``(alpha / r) · B·A``).
        dropout: dropout on the adapter's input in training (0 keeps the on-policy ESS at 1: the learner's
            forward in training mode is then the engine's).
        target_modules: module names (e.g. ``["q_proj", "v_proj"]``) or peft's ``"all-linear"`` (every
            ``Linear`` but the output layer).
        base: the base model's directory, recorded in checkpoints (``base_model_name_or_path``).
        seed: seeds ``A``'s initialisation on a forked random stream, so adding adapters never moves the
            run's own random streams and every data-parallel rank starts from the same adapter.

    Afterwards ``policy.adapter`` is the ``peft.PeftModel`` wrapping ``policy.model`` (which remains the same
    transformers module, now computing ``W x + (α/r)·B A x`` in its adapted layers).

    Raises:
        UserError: the policy already has adapters; ``target_modules`` matches no module of the model, or
            matches an embedding (only linear layers: a tied embedding would also be the output layer), or a layer
            whose weight is tied to another's (the output layer of a model with tie_word_embeddings), or the output
            layer (the chunked LM head takes a plain ``Linear``).
    """
    import peft

    if policy.adapter is not None or has_lora(policy.model):
        raise UserError("the policy already has LoRA adapters; apply model.lora once")
    head = policy.model.get_output_embeddings()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                             target_modules=target_modules if isinstance(target_modules, str) else list(target_modules))
    # manual_seed seeds every CUDA generator too: fork them all, or a GPU run's dropout stream would restart at
    # model.seed on every rank (the fork on CUDA is not run here: no GPU)
    with forked_rngs(), warnings.catch_warnings():
        torch.manual_seed(seed)
        warnings.simplefilter("ignore", FutureWarning)  # peft calls transformers' renamed is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")  # a tied target is refused below
        try:
            wrapped = peft.get_peft_model(policy.model, config)
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            raise UserError(f"model.lora.target_modules={target_modules!r} does not fit the model "
                            f"({str(e).splitlines()[0][:200]}); name its linear layers (e.g. [q_proj, v_proj]) "
                            "or use all-linear") from None
    _refuse_unsupported_targets(policy.model, target_modules, head)
    # set afterwards: get_peft_model overwrites it with the module's own name_or_path (None when built here)
    wrapped.peft_config["default"].base_model_name_or_path = str(base)
    policy.adapter = wrapped


def _refuse_unsupported_targets(model: torch.nn.Module, target_modules, head: torch.nn.Module) -> None:
    """Refuse adapters on an embedding, on a layer whose weight is tied to another's, or on the output layer
    ``head`` (``apply_lora``'s errors)."""
    embeddings = [n for n, m in _lora_layers(model).items() if isinstance(m.get_base_layer(), torch.nn.Embedding)]
    if embeddings:
        raise UserError(f"model.lora.target_modules={target_modules!r} adapts the embedding {embeddings[0]}; "
                        "LoRA here adapts linear layers only: name those (e.g. [q_proj, v_proj]) or use all-linear")
    # a layer whose weight is another module's too (an output layer tied to the input embedding): its merged weight
    # would replace both, so a merged copy (rollout engines, export) would embed its inputs with W + ΔW
    names_of: dict[int, list[str]] = {}
    for n, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(n)
    shared = {n: names_of[id(m.get_base_layer().weight)] for n, m in _lora_layers(model).items()}
    tied = [(n, names) for n, names in shared.items() if len(names) > 1]
    if tied:
        raise UserError(f"model.lora.target_modules={target_modules!r} adapts {tied[0][0]}, whose weight is also "
                        f"{tied[0][1][0]} (tie_word_embeddings); adapt other layers (all-linear leaves it out) or "
                        "untie the model")
    adapted_head = next((n for n, m in _lora_layers(model).items() if m.get_base_layer() is head), None)
    if adapted_head is not None:  # the learner's chunked head multiplies by a plain Linear's weight
        raise UserError(f"model.lora.target_modules={target_modules!r} adapts the output layer {adapted_head}, which "
                        "the learner's chunked LM head cannot run (every [B, C, V] logit would be built at once); "
                        "adapt other layers (all-linear leaves it out)")


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged policy's full state under the base model's names, one ``(name, tensor)`` pair at a time:
    ``W + (α/r)·B·A`` for adapted layers.

    Each adapted weight ``W`` [out, in] becomes ``W + Σ_adapters (α/r)·B·A`` (peft's ``get_delta_weight``, which
    also transposes for ``fan_in_fan_out`` layers), summed in ``W``'s dtype promoted to at least float32 and
    cast back; every other tensor (embeddings, norms, biases, the tied output layer) is the base's, detached.
    Keys drop peft's ``base_layer`` segment, and the ``lora_*`` tensors are left out, so the result loads
    strictly into the base architecture. A model without adapters gives its own state (detached).

    Of an FSDP2 (sharded) model, whole tensors: the merge runs on the DTensor shards (``W``, ``A`` and ``B`` as
    FSDP2 holds them; DTensor gathers what the product needs) and each result is then all-gathered
    (``parallel.full_tensor``), so every rank must iterate it to the end together.
    """
    layers = _lora_layers(model)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            parts = key.split(".")
            if any(p.startswith("lora_") for p in parts):
                continue
            name = ".".join(p for p in parts if p != "base_layer")
            owner, _, leaf = name.rpartition(".")
            layer = layers.get(owner)
            if layer is not None and leaf == "weight":
                work = torch.promote_types(t.dtype, torch.float32)
                merged = t.to(work)
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A and adapter not in layer.merged_adapters:
                        merged = merged + layer.get_delta_weight(adapter).to(work)
                t = merged.to(t.dtype)
            yield name, full_tensor(t.detach())


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of ``model``'s architecture (peft's layers unwrapped) holding ``merged_weights(model)``.

    What a rollout engine that keeps its own copy, or an export, starts from. Every parameter of the copy
    requires grad again, as in a freshly loaded model. A model without adapters is deep-copied as it is.
    """
    state = dict(merged_weights(model))
    plain = copy.deepcopy(model)
    for name in sorted(_lora_layers(plain), key=len, reverse=True):  # innermost first (none nest in practice)
        parent_name, _, child = name.rpartition(".")
        parent = plain.get_submodule(parent_name)
        setattr(parent, child, getattr(parent, child).get_base_layer())
    plain.load_state_dict(state)
    plain.requires_grad_(True)
    return plain


@contextlib.contextmanager
def _unsharded_class(model: torch.nn.Module):
    """``model`` under its own class for the block's duration. FSDP2's ``fully_shard`` gives a sharded module a class
    of its own (``FSDP<Name>``, subclassing ``FSDPModule`` and the module's class), which peft's ``save_pretrained``
    would write into ``adapter_config.json`` (``auto_mapping``: the class peft's ``AutoPeftModel`` loads the base
    with); under the module's own class it writes what an unsharded run writes."""
    from torch.distributed.fsdp import FSDPModule

    sharded = type(model)
    if not issubclass(sharded, FSDPModule):
        yield
        return
    model.__class__ = next(c for c in sharded.__mro__ if not issubclass(c, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = sharded


def save_adapter(policy: Policy, path: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the adapter (peft's ``adapter_config.json`` naming the base, ``adapter_model.safetensors``) and
    the tokenizer to ``path``.

    ``state_dict``: the adapter's whole tensors under ``policy.adapter``'s names, when the module holds them as
    FSDP2 shards (``parallel.full_model_state(policy.adapter, trainable_only=True)``); peft's ``save_pretrained``
    keeps its ``lora_*`` entries, as it does of the module's own state.

    Raises:
        ValueError: the policy has no adapter.
    """
    if policy.adapter is None:
        raise ValueError("the policy has no LoRA adapter to save")
    with _unsharded_class(policy.model):
        policy.adapter.save_pretrained(str(path), state_dict=state_dict)
    policy.tokenizer.save_pretrained(path)


def adapter_base(path: Path) -> str | None:
    """The base model named by the adapter checkpoint at ``path`` (``base_model_name_or_path``).

    Raises:
        UserError: its adapter_config.json is no JSON object (torn by a copy, or not UTF-8).
    """
    f = Path(path) / ADAPTER_CONFIG
    try:
        cfg = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"{str(f)!r} is not valid JSON ({str(e).splitlines()[0]}); copy the checkpoint again") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{str(f)!r} is not a JSON object; copy the checkpoint again")
    return cfg.get("base_model_name_or_path")


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of the checkpoint at ``path`` (peft's names), loaded on CPU.

    Raises:
        FileNotFoundError: no adapter there. Errors of safetensors for a torn or corrupt file.
    """
    from peft.utils import load_peft_weights

    p = Path(path)
    if not (p / ADAPTER_CONFIG).exists() or not (p / ADAPTER_WEIGHTS).exists():
        raise FileNotFoundError(f"{p} holds no LoRA adapter ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
    adapter_base(p)  # a torn config fails here, not after the run has started
    return load_peft_weights(str(p), device="cpu")


@torch.no_grad()
def restore_adapter(policy: Policy, weights: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter tensors (``read_adapter``) into the policy's adapter, exactly (in place, so an
    optimizer built over the adapter's parameters keeps them).

    Raises:
        UserError: the policy has no adapter, or the saved tensors do not fill it (another rank or targets).
    """
    from peft import set_peft_model_state_dict

    if policy.adapter is None:
        raise UserError("the checkpoint holds a LoRA adapter but the run has no model.lora; resume with its config")
    before = {n: p.data_ptr() for n, p in policy.model.named_parameters()}
    result = set_peft_model_state_dict(policy.adapter, weights)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        key = (result.unexpected_keys or missing)[0]
        raise UserError(f"the checkpoint's LoRA adapter does not fit this run's (e.g. {key}); resume with the "
                        "model.lora settings it was trained with")
    moved = [n for n, p in policy.model.named_parameters() if p.data_ptr() != before[n]]
    if moved:  # an optimizer over the old tensors would no longer train the model
        raise RuntimeError(f"restoring the adapter replaced parameter {moved[0]} instead of copying into it")


def load_merged(path: str | Path, load_base, dtype: torch.dtype = torch.float32) -> Policy:
    """A LoRA checkpoint directory as a plain policy: its base (``base_model_name_or_path``) with the
    adapter merged (``W + (α/r)·B·A``) and no peft layers left. ``load_base(dir, dtype=)`` loads the base
    (``policy.model.load_policy``, which calls this for LoRA checkpoints: passed in, so that this module
    does not import the one that imports it).

    Raises:
        UserError: the base the checkpoint names is missing or not a model directory (the message names it),
            or the adapter is unreadable.
    """
    from peft import PeftModel

    p = Path(path)
    base = adapter_base(p)
    # the base may itself be a LoRA checkpoint (a LoRA run that started from one): load_base merges it first
    if not base or not any((Path(base) / f).exists() for f in ("config.json", ADAPTER_CONFIG)):
        raise UserError(f"LoRA checkpoint {str(p)!r} names base model {base!r}, which is not a model directory here; "
                        f"restore the base there or edit base_model_name_or_path in {p / ADAPTER_CONFIG}")
    cfg = json.loads((p / ADAPTER_CONFIG).read_text())
    # merged_weights merges W + scaling·B·A per layer; DoRA's magnitudes and whole trained copies of other modules
    # are more than that
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole trained modules)")):
        if cfg.get(key):
            raise UserError(f"LoRA checkpoint {str(p)!r} uses {what}, which trustbatch cannot merge; merge it with "
                            "peft's merge_and_unload() and give the merged model's directory")
    policy = load_base(base, dtype=dtype)
    try:
        # peft builds the layers from the checkpoint's own config (rslora, alpha_pattern, rank_pattern included)
        policy.adapter = PeftModel.from_pretrained(policy.model, str(p), is_trainable=False)
        weights = read_adapter(p)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise UserError(f"cannot read the LoRA adapter in {str(p)!r} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else 'no message'}); copy it again") from None
    try:  # peft only warns on tensors the config has no layer for, or layers the file has no tensors for
        restore_adapter(policy, weights)
    except UserError:
        raise UserError(f"LoRA checkpoint {str(p)!r}: the adapter's tensors do not match its {ADAPTER_CONFIG} (other "
                        "target modules or ranks); copy the checkpoint again") from None
    policy.model = merged_copy(policy.model)
    policy.adapter = None
    return policy
