"""Checkpoints: the policy in HF format plus every state a bit-identical resume needs, written atomically.

A LoRA policy (``policy.adapter``) is checkpointed as its adapter (``policy.lora.save_adapter``: peft's
``adapter_config.json``, which names the base, and ``adapter_model.safetensors``); resume reads it back
with ``policy.lora.read_adapter`` as ``load_latest``'s loader.

``trainer_state.pt`` holds the round, the learner's optimizer, scheduler and policy version, the
rollout source's prompt sampler (an async source: its next batch and, in deterministic order, the weights of
the rounds that sample the next batches), the weight sync's snapshots (lagged sync), and the torch and Python
random states (rank 0's, and under torchrun every rank's as ``rank_rng``: ``recipes.hooks.TrainHooks.save``). A
checkpoint is written to a temporary folder and renamed, so a kill at any moment leaves the previous checkpoints
intact; a checkpoint whose weights are not finite is never written.

Rotation keeps the ``keep`` newest; with held-out values by round (``checkpoint_keep_best``) it also keeps the best
one, which ``checkpoints/best`` (a relative symlink) names.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..errors import UserError
from ..policy.lora import save_adapter
from ..policy.model import _quiet_transformers
from ..records import umask_modes, write_failure

KEEP = 2  # checkpoints kept by default (checkpoint_keep)
BEST = "best"  # checkpoints/best: the symlink to the best held-out checkpoint (checkpoint_keep_best)


class NonFiniteWeights(UserError):
    """The policy's weights hold NaN or inf: the run stops rather than checkpoint them."""


def save_checkpoint(run_dir: Path, step: int, policy, state: dict, model_state: dict | None = None,
                    keep: int = KEEP, best_of: dict[int, float] | None = None) -> Path:
    """Write ``run_dir/checkpoints/step_XXXXXX`` via a temporary folder and a rename. Returns its path.

    ``state`` is merged into ``trainer_state.pt`` beside ``step`` and the RNG states. ``model_state``: the
    policy's whole state dict when ``policy.model`` is sharded (FSDP2: ``parallel.full_model_state``), or of a LoRA
    policy its adapters' whole tensors under ``policy.adapter``'s names, written in its place, so that the
    checkpoint loads at any world size. Once it is complete, only the ``keep``
    newest checkpoints stay, and with ``best_of`` (held-out accuracy by round) also ``best_checkpoint``'s, named
    by the ``checkpoints/best`` symlink. By induction the best checkpoint ever written stays: it is the best of
    those on disk at every save, so no rotation deletes it.

    Raises:
        NonFiniteWeights: a weight is NaN or inf (nothing is written).
    """
    weights = policy.model.state_dict() if model_state is None else model_state
    bad = [n for n, p in weights.items() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise NonFiniteWeights(f"the policy's weights hold NaN or inf ({bad[0]}); not checkpointing them. "
                               "Lower train.lr or raise train.grad_clip, and resume from the last checkpoint")
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, since = root / f"step_{step:06d}", time.time()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        with _quiet_transformers():  # peft's save too: no "Writing model shards" progress bar at every checkpoint
            if getattr(policy, "adapter", None) is not None:
                # LoRA: the adapter and its base's name, not the merged model
                save_adapter(policy, tmp, state_dict=model_state)
            elif model_state is None:
                policy.save(tmp)
            else:
                policy.save(tmp, state_dict=model_state)
        torch.save({
            "step": step,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            **state,
        }, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        umask_modes(tmp)
        os.replace(tmp, final)
    except BaseException as e:
        try:  # told before the cleanup: removing the torn files frees the very space that ran out
            cause = write_failure(root, e, since) if isinstance(e, (RuntimeError, SafetensorError)) else None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if cause is not None:
            raise cause from e
        raise
    best = None if best_of is None else best_checkpoint(run_dir, best_of)
    if best_of is not None:
        _name_best(root, best)
    # the one just written stays too: a later round's folder on disk (left by a resume that fell back past a corrupt
    # newest checkpoint) would otherwise push it out of the ``keep`` newest
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        if old not in (best, final):
            shutil.rmtree(old, ignore_errors=True)
    return final


def step_of(ckpt: Path) -> int:
    """The round of a checkpoint folder ``step_XXXXXX``."""
    return int(Path(ckpt).name.removeprefix("step_"))


def best_checkpoint(run_dir: Path, heldout: dict[int, float]) -> Path | None:
    """The complete checkpoint whose round has the highest ``heldout`` value (held-out accuracy by round), the
    earliest on ties; None when no checkpoint's round has one (it was not evaluated)."""
    scored = [(heldout[step_of(p)], -step_of(p), p) for p in checkpoints(run_dir) if step_of(p) in heldout]
    return max(scored)[2] if scored else None


def _name_best(root: Path, best: Path | None) -> None:
    """Point ``root/best`` at ``best`` (relative, so a copied run directory keeps it), or remove it for None; the
    link is replaced by a rename, never left missing or half-made."""
    link = root / BEST
    if best is None:
        link.unlink(missing_ok=True)
        return
    tmp = root / f".tmp-{BEST}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(best.name, tmp)
    os.replace(tmp, link)


def clean_temporaries(run_dir: Path) -> int:
    """Remove temporary checkpoint folders (and ``best`` links) left by a kill during a write. Returns how many."""
    tmps = list((Path(run_dir) / "checkpoints").glob(".tmp-*"))
    for t in tmps:
        if t.is_symlink():
            t.unlink(missing_ok=True)
        else:
            shutil.rmtree(t, ignore_errors=True)
    return len(tmps)


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / "trainer_state.pt").exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    cands = checkpoints(run_dir)
    return cands[-1] if cands else None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "trainer_state.pt", weights_only=False)


def load_latest(run_dir: Path, load_policy) -> tuple[Path, object, dict] | None:
    """The newest checkpoint that loads: ``(path, policy, trainer_state)``, or None if there is none.

    A checkpoint that fails to load (corrupt weights or state) is skipped with a warning, and the
    previous one is tried.
    """
    for ckpt in reversed(checkpoints(run_dir)):
        try:
            state = load_trainer_state(ckpt)
            policy = load_policy(ckpt)
        except Exception as e:  # a torn or corrupt file: torch, safetensors and HF raise many types
            warnings.warn(f"checkpoint {ckpt.name} does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          "trying the previous one", stacklevel=2)
            continue
        return ckpt, policy, state
    return None
