"""A Ctrl-C (or SIGTERM, ``interrupt_guard``) while a base is written to the cache leaves no half-written folder
there: the temporary sibling was removed on ``OSError`` only, and a ``KeyboardInterrupt`` mid-save kept it for good."""

import pytest

from trustbatch.config import load_config
from trustbatch.policy import model as policy_model
from trustbatch.policy import shipped
from trustbatch.recipes import prepare_run

from tiny import TINY


def test_an_interrupted_base_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    saved = policy_model.Policy.save

    def save_then_interrupt(self, path):
        saved(self, path)  # the files are written: the interrupt comes before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(policy_model.Policy, "save", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_run(load_config(None, TINY + ["reward.workers=0", "model.sft_steps=1"]))
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".tmp-")] == []
    assert not [p for p in (tmp_path / "cache").rglob("config.json")]  # and no base was taken as built


def test_an_interrupted_install_of_the_shipped_base_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "shipped"
    src.mkdir()
    for f in (*shipped.BASE_FILES, shipped.MANIFEST):
        (src / f).write_text("x")
    real_copy, copied = shipped.shutil.copyfile, []

    def copy_then_interrupt(a, b):
        if copied:  # the second file: one is in the temporary folder
            raise KeyboardInterrupt
        copied.append(b)
        return real_copy(a, b)

    monkeypatch.setattr(shipped.shutil, "copyfile", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        shipped.install_shipped(src, tmp_path / "cache" / "base")
    assert list((tmp_path / "cache").iterdir()) == []
