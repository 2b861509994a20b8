"""Issue 45 item 3: ``checkpoint_keep_best`` keeps the best held-out checkpoint beside the ``checkpoint_keep`` newest,
names it ``checkpoints/best``, and ``trustbatch export RUN --step best`` picks it.

A tiny run evaluated and checkpointed every round with ``checkpoint_keep=1``, scored by a scripted reward whose
held-out accuracy peaks at round 2 of 4 (``scorers_for_tests.by_round``: the same on every CPU); the best round is
read from ``metrics.jsonl`` here, by hand, and must not be the last (else "best" and "newest" would be one)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from trustbatch.cli import main
from trustbatch.config import load_config
from trustbatch.recipes import train

from runproc import cache  # noqa: F401  (the tiny base, built once)
from tiny import TINY

RUN = TINY + ["reward.name=scorers_for_tests:by_round", "reward.workers=0", "threads=1", "train.steps=4",
              "eval.every=1", "checkpoint_every=1", "checkpoint_keep=1", "checkpoint_keep_best=true"]


def _cli(monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    """``trustbatch`` through ``cli.main`` in this process: (exit code, stdout with rich's wrapping undone, stderr)."""
    monkeypatch.setattr("sys.argv", ["trustbatch", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code or 0, " ".join(out.out.split()), out.err


def test_the_best_held_out_checkpoint_survives_rotation_and_exports(tmp_path, cache, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv("TRUSTBATCH_TEST_SCRIPT_RUN", str(run))
    train(load_config(None, RUN + [f"run_dir={run}"]))
    heldout = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "heldout_accuracy" in rec:
            heldout[rec["step"]] = rec["heldout_accuracy"]
    assert sorted(heldout) == [0, 1, 2, 3, 4]  # every round evaluated (and checkpointed), the base too
    top = max(heldout.values())
    best = min(s for s, v in heldout.items() if v == top)  # the earliest of the highest
    assert best == 2, heldout  # the script's peak: neither the base nor the last round
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(["best", f"step_{best:06d}", "step_000004"])
    assert (ckpts / "best").is_symlink() and os.readlink(ckpts / "best") == f"step_{best:06d}"

    out = tmp_path / "export"
    code, said, _ = _cli(monkeypatch, capsys, "export", str(run), "--step", "best", "--out", str(out))
    assert code == 0
    assert f"exported round {best} " in said and f"held-out accuracy {top:.4f}" in said, said
    exported = load_file(out / "model.safetensors")
    kept = load_file(ckpts / f"step_{best:06d}" / "model.safetensors")
    assert exported.keys() == kept.keys() and all(torch.equal(exported[k], kept[k]) for k in kept)


def test_without_it_no_best_is_named_and_export_best_says_so_in_one_line(tmp_path, cache, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv("TRUSTBATCH_TEST_SCRIPT_RUN", str(run))
    train(load_config(None, RUN[:-1] + ["train.steps=2", f"run_dir={run}"]))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    code, _, stderr = _cli(monkeypatch, capsys, "export", str(run), "--step", "best", "--out", str(tmp_path / "x"))
    assert code == 2
    err = [line for line in stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "names no best checkpoint" in err[0] and "checkpoint_keep_best=true" in err[0], err
    assert not (tmp_path / "x").exists()
