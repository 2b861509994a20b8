"""The shipped default base (``policy.shipped``) and its key recomputed from the default config, for the tests."""

import hashlib
import json
from pathlib import Path

from trustbatch.config import load_config
from trustbatch.policy import base as base_mod
from trustbatch.policy.shipped import SHIPPED_DIR


def default_key() -> tuple[str, dict, dict]:
    """(key, task settings, model settings) of the default config: sha256 of the sorted-key JSON of the base format,
    the task and the model settings (the held-out reserve, equal to the held-out size here, LoRA, a Hub revision and
    the reference policy of a reference KL aside), first 16 hex digits, as ``policy.base`` documents it."""
    cfg = load_config()
    task = {k: v for k, v in cfg.task.model_dump(mode="json").items() if k != "heldout_reserve"}
    model = {k: v for k, v in cfg.model.model_dump(mode="json").items() if k not in ("lora", "revision", "reference")}
    blob = json.dumps({"format": base_mod.BASE_FORMAT, "task": task, "model": model}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16], task, model


def shipped() -> tuple[Path, dict]:
    """The one shipped base folder and its manifest."""
    folders = sorted(p for p in SHIPPED_DIR.iterdir() if p.is_dir())
    assert len(folders) == 1, folders
    return folders[0], json.loads((folders[0] / "BASE.json").read_text())
