"""Default bases shipped with the package: a fresh machine starts from the base the README's numbers came from.

A base build (SFT warm-up of the small Llama) takes minutes on a laptop and far longer on a loaded machine, and
its bytes depend on the machine and package versions; so the default config's base ships as package data, under
``policy/bases/{task}-{key}/`` (the cache's layout) with a ``BASE.json`` manifest: the base key, the task and
model settings it was built from, the command that built it, and the sha256 of every file.

A shipped base is used only when its manifest's key equals the run's key (``base.base_key``) and every file's
sha256 matches the manifest: a base with another key, or edited bytes, is never taken for the run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..records import umask_modes

SHIPPED_DIR = Path(__file__).resolve().parent / "bases"
MANIFEST = "BASE.json"
BASE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_base(name: str, key: str, root: Path = SHIPPED_DIR) -> tuple[Path | None, str]:
    """The shipped base directory for ``{name}-{key}`` and ``""``, or ``(None, why not)``.

    ``name``: the task's name; ``key``: ``base.base_key`` of the run's task and model settings. The folder must
    hold a manifest whose ``key`` is ``key`` and files whose sha256 match it; the reason names what failed.
    """
    d = root / f"{name}-{key}"
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "no base with this key ships with trustbatch"
    except (OSError, ValueError) as e:
        return None, f"the shipped base's {MANIFEST} is unreadable ({e})"
    if manifest.get("key") != key:
        return None, f"the shipped base's manifest names key {manifest.get('key')!r}, not {key!r}"
    for f, want in sorted(manifest.get("sha256", {}).items()):
        try:
            got = file_sha256(d / f)
        except OSError:
            return None, f"the shipped base lacks {f}"
        if got != want:
            return None, f"the shipped base's {f} has sha256 {got[:12]}…, not the manifest's {want[:12]}…"
    missing = [f for f in BASE_FILES if f not in manifest.get("sha256", {})]
    if missing:
        return None, f"the shipped base's manifest lists no sha256 for {missing[0]}"
    return d, ""


def shipped_manifests(name: str, root: Path = SHIPPED_DIR) -> list[dict]:
    """The readable manifests of the bases shipped for task ``name`` (any key)."""
    out = []
    for d in sorted(root.glob(f"{name}-*")):
        try:
            out.append(json.loads((d / MANIFEST).read_text()))
        except (OSError, ValueError):
            continue
    return out


def install_shipped(src: Path, final: Path) -> Path:
    """Copy a shipped base's files into the cache folder ``final`` (written to a temporary sibling and renamed),
    so that checkpoints and LoRA adapters name a path that stays put across reinstalls. Returns the folder to
    load: ``final``, or ``src`` itself when the cache cannot be written (a read-only home)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    except OSError:
        return src
    try:
        for f in (*BASE_FILES, MANIFEST):  # the manifest too: the cache then says where its base came from
            shutil.copyfile(src / f, tmp / f)
        umask_modes(tmp)
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").exists():
            return src
    except BaseException:  # a Ctrl-C or SIGTERM mid-copy: no half-written folder left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
