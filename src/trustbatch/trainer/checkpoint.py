"""Checkpoints: the policy in HF format plus optimizer state, step and RNG states, written atomically."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

KEEP = 2  # checkpoints kept besides the newest ones being written


def save_checkpoint(run_dir: Path, step: int, policy, optimizer, extra: dict | None = None) -> Path:
    """Write ``run_dir/checkpoints/step_XXXXXX`` via a temporary folder and a rename. Returns its path."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        policy.save(tmp)
        torch.save({
            "step": step,
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            **(extra or {}),
        }, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    cands = sorted(p for p in root.glob("step_*") if (p / "trainer_state.pt").exists())
    return cands[-1] if cands else None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "trainer_state.pt", weights_only=False)
