"""``model.path`` as a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``), resolved as transformers resolves one.

A path that exists is a local directory and is used as it is. Anything else shaped like a hub id (``name`` or
``owner/name``, no path separators beyond the one) goes to ``huggingface_hub.snapshot_download``, which reads and
fills the hub cache (``HF_HOME``, ``HF_HUB_CACHE``), honours ``HF_HUB_OFFLINE=1`` and falls back to the cache when
the hub cannot be reached. Only what ``load_policy`` reads is fetched: configs, tokenizer files and safetensors
weights (a repo's ``.bin``, ONNX or GGUF copies are left on the hub).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from ..errors import UserError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_WANTED = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_hub_id(path: str) -> bool:
    """Whether ``path`` is no existing file or directory and has the shape of a hub repo id."""
    return not Path(path).expanduser().exists() and bool(_REPO_ID.match(path)) and not path.startswith((".", "~"))


def model_dir(path: str | Path, revision: str | None = None, key: str = "model.path") -> Path:
    """The local directory of ``path``: itself, or a hub id's snapshot in the hub cache (module docstring). ``key``
    names the setting in the message.

    Raises:
        UserError: a hub id that is neither in the cache nor downloadable; the line names the id, the revision and
            whether the hub is offline (``HF_HUB_OFFLINE``).
    """
    if not is_hub_id(str(path)):
        return Path(path).expanduser()
    return _snapshot(str(path), revision, key)


@functools.lru_cache(maxsize=None)  # a run resolves its model several times (context, load, checkpoint base)
def _snapshot(path: str, revision: str | None, key: str = "model.path") -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(path, revision=revision, allow_patterns=_WANTED))
    except Exception as e:  # noqa: BLE001 - every hub failure (missing, offline, gated, network) is one line
        at = f" at revision {revision!r}" if revision else ""
        state = ("HF_HUB_OFFLINE=1, and it is not in the hub cache" if constants.HF_HUB_OFFLINE
                 else f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
        # huggingface_hub 1.x ships `hf` alone: its huggingface-cli is gone
        get = f"hf download {path}" + (f" --revision {revision}" if revision else "")
        raise UserError(f"{key}={str(path)!r} is no local directory, and as a Hugging Face Hub id{at} it could not "
                        f"be loaded ({state}); give a local model directory, or download the model first "
                        f"({get})") from None
