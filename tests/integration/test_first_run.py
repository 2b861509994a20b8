"""Issue 37 (item 7): a first run that explains itself. A fresh cache starts from the shipped base without building;
a build says why and shows its SFT steps; an interrupt before the first checkpoint leaves a directory that starts
again; each evaluation writes sample completions."""

import hashlib

from trustbatch.config import load_config
from trustbatch.policy import base as base_mod
from trustbatch.recipes import prepare_run, task_key

from shipped import default_key, shipped


def test_an_empty_cache_loads_the_shipped_base_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))

    def no_build(*a, **k):
        raise AssertionError("the base was built (an SFT step ran)")

    monkeypatch.setattr(base_mod, "sft", no_build)
    monkeypatch.setattr("trustbatch.recipes.base.build_base", no_build)
    cfg = load_config(None, ["reward.workers=0"])
    _, policy, pool, source = prepare_run(cfg)
    pool.close()
    key, _, _ = default_key()
    copy = tmp_path / "cache" / "base" / f"chain_sum-{key}"
    assert source == f"{copy} (shipped)"
    folder, manifest = shipped()
    assert hashlib.sha256((copy / "model.safetensors").read_bytes()).hexdigest() == manifest["sha256"]["model.safetensors"]
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    loaded = dict(policy.model.state_dict())
    assert all(k in loaded and bool((loaded[k] == v).all()) for k, v in weights.items())
    # the second start finds the cache's copy
    assert base_mod.find_base("chain_sum", task_key(cfg), cfg.model.model_dump(mode="json")) == (copy, "cached")
