"""The default base for a run, shown: found in the cache or shipped with the package, or built with a line saying
why and a progress display of the SFT warm-up (step, loss, ETA)."""

from __future__ import annotations

from pathlib import Path

from ..policy import Policy, load_policy
from ..policy.base import build_base, find_base
from ..trainer.progress import Progress


def load_default_base(task, task_cfg: dict, model_cfg: dict, console=None) -> tuple[Policy, Path, str]:
    """``(policy, folder, how)`` for the default base of these settings; ``how``: ``"cached"``, ``"shipped"``
    (``policy.shipped``) or ``"built now"``.

    ``task_cfg``: ``recipes.build.task_key``; ``model_cfg``: the ``model`` section as a dict. With a ``console``, a
    build first says why (no base with this key is cached or shipped) and how long it is, then shows each SFT step's
    loss (token-mean NLL, nats) with an ETA.
    """
    path, how = find_base(task.name, task_cfg, model_cfg)
    if path is not None:
        return load_policy(path), path, how
    steps = model_cfg["sft_steps"]
    if console is not None:
        console.print(f"building the default base: {how}; {steps} SFT steps, then cached for later runs",
                      highlight=False, soft_wrap=True, markup=False)
    with Progress(console, total=steps, label="SFT", unit="SFT step", max_every=None,
                  enabled=console is not None) as bar:
        path = build_base(task, task_cfg, model_cfg, on_step=lambda s, loss: bar.advance(s + 1, f"loss {loss:.3f}"))
    return load_policy(path), path, "built now"
