"""``trustbatch train`` whose checkpoints folder turns read-only in the middle of a checkpoint write.

Run under ``unshare -m`` (a mount namespace of its own, so nothing outside sees the mounts): the run's
``checkpoints`` folder is bind-mounted onto itself and remounted read-only just before safetensors writes the
weights of checkpoint number ``N`` (its temporary folder and config already written), the moment a disk that turns
read-only would meet it.

Usage: unshare -m python readonly_checkpoint.py RUN_DIR N TRAIN_OVERRIDES...
"""

import subprocess
import sys
from pathlib import Path


def main() -> None:
    run_dir, n, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    import transformers.modeling_utils as hf

    real, calls = hf.safe_save_file, []

    def save_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == n:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        return real(*args, **kwargs)

    hf.safe_save_file = save_file
    from trustbatch.cli import main as cli

    sys.argv = ["trustbatch", "train", *overrides, f"run_dir={run_dir}"]
    cli()


if __name__ == "__main__":
    main()
