"""The ``trustbatch`` command: ``train`` and ``sft`` (``eval`` and ``lab`` come with their issues).

Bad input (a config key, a value, a path, a name) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="RL post-training of language models with the batch-adaptive P3O objective.")


@app.command()
def train(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value (e.g. objective.name=grpo)"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue the run in RUN_DIR from its last checkpoint"),
):
    """Run RL post-training. With no arguments: P3O on reasoning-gym chain_sum with the default small base."""
    from .config import load_config
    from .trainer.loop import train as run

    if resume and config:
        raise UserError("--resume uses the run's saved config; give overrides as key=value instead of --config")
    cfg = None if resume else load_config(config, overrides)
    run(cfg, resume=resume, overrides=overrides if resume else None)


@app.command()
def sft(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file"),
    out: Optional[str] = typer.Option(None, "--out", help="also save the SFT policy here (HF format)"),
):
    """Supervised warm-up on the task's demonstrations: builds (and caches) the default base, or SFTs model.path."""
    from rich.console import Console

    from .config import load_config
    from .policy import load_policy
    from .policy.base import default_base, sft_demos
    from .policy.sft import sft as run_sft
    from .trainer.loop import configured_task

    console = Console()
    cfg = load_config(config, overrides)
    task = configured_task(cfg)
    model_cfg = cfg.model.model_dump(mode="json")
    if cfg.model.path is None:
        policy, path, built = default_base(task, cfg.task.model_dump(mode="json"), model_cfg)
        console.print(f"default base {'built' if built else 'already cached'} at {path}")
    else:
        if out is None:
            raise UserError("SFT of model.path needs --out DIR for the result")
        policy = load_policy(cfg.model.path)
        loss = run_sft(policy, sft_demos(task, model_cfg), steps=cfg.model.sft_steps,
                       batch_size=cfg.model.sft_batch_size, lr=cfg.model.sft_lr, seed=cfg.model.seed)
        console.print(f"SFT done, last loss {loss:.4f}")
    if out is not None:
        policy.save(out)
        console.print(f"saved to {out}")


def main() -> None:
    try:
        app()
    except UserError as e:
        print(f"trustbatch: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("trustbatch: interrupted; the last checkpoint is intact (use --resume RUN_DIR)", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
