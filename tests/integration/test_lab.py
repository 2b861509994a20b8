"""``trustbatch lab``: every bundled experiment loads, a miniature experiment runs, resumes and is reported."""

import hashlib
import json
import os
import re
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from trustbatch.errors import UserError
from trustbatch.lab import load_experiment, run_experiment
from trustbatch.lab.experiment import bundled_experiments, default_comparisons, family_and_dose
from trustbatch.lab.archive import archive_runs
from trustbatch.lab.bases import check_bases
from trustbatch.lab.report import write_report
from trustbatch.lab.report.runs import mean_se

from tiny import TINY

BUNDLED = sorted(bundled_experiments())
# pre-flight-only and validation experiments; the rest are comparisons and need Lab II's six seeds
FEW_SEEDS = {"precision_doses": 2, "collapse_check": 2, "calibrate_batch": 2, "replay_ratios": 2, "reference_steps": 3,
             "temperature_t12_steps": 4}  # the T = 1.2 dose: 4 seeds, the budget it had (docs/lab3/README.md)
ONE_ARM = {"reference", "reference_steps"}  # the shared on-policy reference: one arm by design


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_experiments_load_with_their_seeds(name):
    exp = load_experiment(name)
    assert len(exp.seeds) >= FEW_SEEDS.get(name, 6) and len(exp.arms) >= (1 if name in ONE_ARM else 2)
    assert all(len(a.split("@")) <= 2 for a in exp.arms)  # family@dose
    # confirm_fp8 (a registered design with one primary comparison) and temperature_t12_steps (budget-bound): no
    # on-policy arm (docs/lab3); confirm_t12's on-policy arms are both objectives at T = 1.0 (its interaction)
    if name not in FEW_SEEDS and name not in ("two_anchor", "ess_scope", "reference", "reference_steps", "confirm_fp8",
                                              "temperature_t12_steps", "confirm_t12"):
        assert "onpolicy" in exp.arms  # every shift experiment has the on-policy reference


def test_the_registered_confirmatory_experiment_has_the_registered_design():
    """docs/lab3/registration.md: 8 seeds (10-17) each with its own base, 50 rounds, held-out 256 x 8 at rounds 0, 25,
    50, one primary comparison, P3O with k3 as the secondary arm, FP8-E4M3 rollouts on chain_sum_steps."""
    exp = load_experiment("confirm_fp8")
    assert exp.seeds == list(range(10, 18)) and exp.per_seed_base and not exp.preflight_only and not exp.tune_arms
    assert set(exp.arms) == {"p3o_exact@fp8", "grpo_eps0.4@fp8", "p3o@fp8"}
    assert exp.compare == [("p3o_exact@fp8", "grpo_eps0.4@fp8")] and len(exp.runs) == 24
    for arm in exp.arms:
        o = dict(x.split("=", 1) for x in exp.overrides(arm, 13))
        assert (o["train.steps"], o["eval.every"], o["eval.samples_per_prompt"]) == ("50", "25", "8")  # rounds 0, 25, 50
        assert (o["task.name"], o["rollout.precision"], o["model.seed"]) == ("chain_sum_steps", "fp8_e4m3", "13")
    assert exp.arms["p3o_exact@fp8"]["objective.options"] == {"kl": "exact"}
    assert exp.arms["grpo_eps0.4@fp8"]["objective.options"] == {"eps_low": 0.4, "eps_high": 0.4}
    assert "objective.options" not in exp.arms["p3o@fp8"]  # P3O's default, the k3 estimator
    assert exp.registered == "c168f4f"  # the commit that added the registration, before any run


def test_report_checks_a_registered_design_against_its_calls(monkeypatch):
    from trustbatch.lab.report import provenance

    history = {"reg": set(), "b": {"reg"}, "c": {"b", "reg"}, "old": set()}
    monkeypatch.setattr(provenance, "descends", lambda commit, ancestor: commit == ancestor or ancestor in history[commit])
    calls = [{"start": 1, "commit": "c"}, {"start": 2, "commit": "b"}, {"legacy_wall_s": 5.0}]
    line = provenance.registration_line("reg", calls)
    assert line == "**Registered** at `reg` before any run: every `lab run` call's commit (`b`, `c`) descends from it."
    line = provenance.registration_line("reg", calls + [{"start": 3, "commit": "old"}])
    assert "**not before every run**: the calls at `old` do not descend from it" in line
    assert provenance.registration_line("reg", []).endswith("no `lab run` call recorded yet.")
    assert provenance.registration_line(None, calls) is None


def test_descends_reads_this_checkout_history():
    from trustbatch.lab.report import descends, git_commit

    head = git_commit()
    if descends(head, head) is None:
        pytest.skip("no git history here")
    assert descends(head, "65a2513") is True and descends("65a2513", head) is False  # the rules' commit is old


def test_bad_experiment_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"arms": {"a": {"train.stepz": 3}}}))
    with pytest.raises(UserError, match="arm 'a': unknown config key 'train.stepz'"):
        load_experiment(str(bad))
    with pytest.raises(UserError, match="no experiment 'nope'"):
        load_experiment("nope")


def test_miniature_experiment_runs_resumes_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    common.update({"train.steps": 2, "eval.every": 1, "checkpoint_every": 1})
    spec = {"description": "tiny", "common": common, "seeds": [0, 1], "registered": "65a2513",
            "arms": {"onpolicy": {},
                     "p3o@T1.2": {"objective.name": "p3o", "rollout.temperature": 1.2},
                     "grpo@T1.2": {"objective.name": "grpo", "rollout.temperature": 1.2}}}
    f = tmp_path / "tiny_exp.yaml"
    f.write_text(yaml.safe_dump(spec))
    exp = load_experiment(str(f))
    out = tmp_path / "runs"
    res = run_experiment(exp, out, jobs=2)
    assert res["failed"] == [] and res["done"] == 6
    for arm in exp.arms:
        for seed in (0, 1):
            d = out / "tiny_exp" / arm / f"seed{seed}"
            assert json.loads((d / "summary.json").read_text())["steps"] == 2
            cfg = yaml.safe_load((out / "tiny_exp" / arm / f"seed{seed}.yaml").read_text())
            assert cfg["train"]["seed"] == seed and cfg["model"]["seed"] == seed  # each seed its own base
            assert cfg["rollout"]["temperature"] == (1.0 if arm == "onpolicy" else 1.2)
    mtime = (out / "tiny_exp" / "p3o@T1.2" / "seed0" / "summary.json").stat().st_mtime
    run_experiment(exp, out, jobs=2)  # everything done: nothing reruns
    assert (out / "tiny_exp" / "p3o@T1.2" / "seed0" / "summary.json").stat().st_mtime == mtime
    report = write_report(out, tmp_path / "report")
    text = report.read_text()
    # one comparison (p3o vs grpo at the same dose; the reference is not a contestant), over the two seeds
    assert "## tiny_exp" in text and "p3o@T1.2 − grpo@T1.2" in text and "over 2 seeds" in text
    assert "1 paired comparisons" in text and "| onpolicy |" in text
    assert yaml.safe_load((out / "tiny_exp" / "experiment.yaml").read_text())["registered"] == "65a2513"
    assert "**Registered** at `65a2513` before any run: " in text  # the runner carried it, the report checked it
    assert "6 runs of 2 rounds × 4 prompts;" in text  # read from the runs' own configs (TINY: 4 per round)
    for fig in ("tiny_exp_dose.png", "tiny_exp_curves.png", "tiny_exp_traces.png", "tiny_exp_ratios.png"):
        assert (tmp_path / "report" / fig).stat().st_size > 1000 and f"]({fig})" in text
    # the archive (no checkpoints) rebuilds the same report once the run folders are gone
    archive_runs(out, tmp_path / "archive")
    assert not list((tmp_path / "archive").rglob("checkpoints")) and list((out / "tiny_exp").rglob("checkpoints"))
    # each run's base, named by key and the SHA-256 of its weights, hashed here from the cache's files
    bases = json.loads((tmp_path / "archive" / "tiny_exp" / "bases.json").read_text())
    cached = {p.parent.name.rsplit("-", 1)[1]: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in (tmp_path / "cache" / "base").glob("*/model.safetensors")}
    assert sorted(bases) == sorted(f"{a}/seed{s}" for a in exp.arms for s in (0, 1))
    assert all(cached[b["key"]] == b["sha256"] for b in bases.values())
    assert bases["onpolicy/seed0"] == bases["grpo@T1.2/seed0"] and bases["onpolicy/seed0"] != bases["onpolicy/seed1"]
    assert set(check_bases(tmp_path / "archive" / "tiny_exp", out / "tiny_exp").values()) == {"reproduction"}
    again = write_report(tmp_path / "archive", tmp_path / "report2").read_text()
    stamp = re.compile(r"Generated \d{4}-\d\d-\d\d \d\d:\d\d")  # the two reports may straddle a minute
    assert stamp.sub("", again.replace(str(tmp_path / "archive"), str(out)).replace("report2", "report")) == stamp.sub("", text)


def test_archive_follows_linked_arms_skips_unfinished_runs_and_replaces_whole(tmp_path):
    ref = tmp_path / "runs" / "reference" / "onpolicy"
    (ref / "seed0").mkdir(parents=True)
    (ref / "seed0" / "summary.json").write_text('{"steps": 1}')
    (ref / "seed0" / "metrics.jsonl").write_text('{"step": 0}\n')
    (ref / "seed0.yaml").write_text("train: {seed: 0}\n")
    exp = tmp_path / "runs" / "shift"
    (exp / "p3o@x" / "seed0" / "checkpoints" / "step_1").mkdir(parents=True)
    (exp / "p3o@x" / "seed0" / "checkpoints" / "step_1" / "model.bin").write_bytes(b"\0" * 4096)
    (exp / "p3o@x" / "seed0" / "metrics.jsonl").write_text('{"step": 0}\n')  # unfinished: no summary.json
    (exp / "experiment.yaml").write_text("arms: {onpolicy: {}, p3o@x: {}}\n")
    (exp / "onpolicy").symlink_to(ref)
    dest = tmp_path / "archive"
    (dest / "shift").mkdir(parents=True)
    (dest / "shift" / "stale.txt").write_text("from an older archive")
    sizes = archive_runs(tmp_path / "runs", dest, ["shift"])
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    # the run files are packed, one file per experiment; bases.json names each run's base
    assert got == ["shift/bases.json", "shift/experiment.yaml", "shift/runs.tar.xz"]
    with tarfile.open(dest / "shift" / "runs.tar.xz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert members == {"onpolicy/seed0.yaml": b"train: {seed: 0}\n", "onpolicy/seed0/metrics.jsonl": b'{"step": 0}\n',
                       "onpolicy/seed0/summary.json": b'{"steps": 1}'}  # the linked arm's files, not a link
    assert sizes == {"shift": sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())}
    first = (dest / "shift" / "runs.tar.xz").read_bytes()
    archive_runs(tmp_path / "runs", dest, ["shift"])  # the same runs pack to the same bytes: nothing new for git
    assert (dest / "shift" / "runs.tar.xz").read_bytes() == first
    assert not [p for p in dest.iterdir() if p.name.startswith(".")]  # no temporary folders left behind
    with pytest.raises(UserError, match="no experiment folder nope"):
        archive_runs(tmp_path / "runs", dest, ["nope"])


def test_standard_error_and_arm_names():
    m, se = mean_se([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(se - (1.0 / 3 ** 0.5)) < 1e-12  # sample sd 1, over √3
    assert family_and_dose("grpo_eps0.2@int8") == ("grpo_eps0.2", "int8")
    assert family_and_dose("onpolicy") == ("onpolicy", None)
    arms = ["onpolicy", "p3o@bf16", "grpo_eps0.2@bf16", "grpo_eps0.4@bf16", "p3o@int8", "grpo_eps0.2@int8", "p3o_exact@int8"]
    assert default_comparisons(arms) == [("p3o@bf16", "grpo_eps0.2@bf16"), ("p3o@bf16", "grpo_eps0.4@bf16"),
                                         ("p3o@int8", "grpo_eps0.2@int8"), ("p3o_exact@int8", "grpo_eps0.2@int8")]


def test_shared_base_build_dedups_foreign_model_mappings(monkeypatch):
    """The bundled foreign experiment gives ``rollout.foreign_model`` as a mapping (unhashable as is): each seed
    builds its own base once and the foreign base once, whatever the number of arms sharing them."""
    import trustbatch.recipes.build as build
    from trustbatch.lab.runner import build_shared_base

    calls = []

    class _Pool:
        def close(self):
            pass

    def prepare_run(cfg):
        calls.append(("base", cfg.model.seed))
        return None, None, _Pool(), None

    monkeypatch.setattr(build, "prepare_run", prepare_run)
    monkeypatch.setattr(build, "foreign_engine", lambda cfg, task, policy: calls.append(("foreign", cfg.model.seed)))
    exp = load_experiment("foreign", seeds=[0, 1])

    class _Quiet:
        def print(self, *a, **k):
            pass

    build_shared_base(exp, _Quiet())
    # each seed's base once (onpolicy, own_only and the foreign arms share it), then the foreign base once: its
    # mapping sets its own seed, so it is one model for every seed (its build loads seed 0's cached base first)
    assert calls == [("base", 0), ("base", 1), ("base", 0), ("foreign", 0)]


def test_preflight_only_arms_are_probed_but_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    common.update({"train.steps": 1, "eval.every": 1, "checkpoint_every": 1})
    spec = {"description": "tiny", "common": common, "seeds": [0], "preflight_only": ["grpo@T1.2"],
            "compare": [["p3o@T1.2", "grpo@T1.2"]],
            "arms": {"p3o@T1.2": {"objective.name": "p3o", "rollout.temperature": 1.2},
                     "grpo@T1.2": {"objective.name": "grpo", "rollout.temperature": 1.2}}}
    f = tmp_path / "tiny_only.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    # a registered pair of an arm that never trains would leave the family silently: refused, not dropped
    with pytest.raises(UserError, match="names a preflight_only arm, which never trains"):
        load_experiment(str(f))
    spec["compare"] = []
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    exp = load_experiment(str(f))
    assert list(exp.arms) == ["p3o@T1.2", "grpo@T1.2"] and exp.run_arms == ["p3o@T1.2"] and exp.compare == []
    res = run_experiment(exp, tmp_path / "runs", jobs=1)
    assert res["done"] == 1 and res["failed"] == []
    assert (tmp_path / "runs" / "tiny_only" / "p3o@T1.2" / "seed0" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "tiny_only" / "grpo@T1.2").exists()
    from trustbatch.lab.report.tables import preflight_table

    exp_dir = tmp_path / "runs" / "tiny_only"
    (exp_dir / "preflight.json").write_text(json.dumps({"seeds": [0], "arms": [{"arm": "p3o@T1.2"}, {"arm": "grpo@T1.2"}]}))
    marked = [ln for ln in preflight_table(exp_dir) if "pre-flight only" in ln]
    assert len(marked) == 1 and marked[0].startswith("| grpo@T1.2 (pre-flight only")
    spec["preflight_only"] = ["nope"]
    f.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match="'preflight_only' must be a list naming arms"):
        load_experiment(str(f))


def _fake_run(exp_dir, arm, seed, base, final):
    """A finished run folder as `trustbatch train` leaves it, with held-out pass@1 ``base`` at round 0 and
    ``final`` at rounds 50 and 100 (so its primary score is ``final``)."""
    d = exp_dir / arm / f"seed{seed}"
    d.mkdir(parents=True)
    rows = [{"step": 0, "heldout_accuracy": base}] + [{"step": s, "reward_mean": 0.5} for s in range(1, 101)]
    rows[50]["heldout_accuracy"] = rows[100]["heldout_accuracy"] = final
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"steps": 100, "wall_s": 60.0}))


def test_tuned_baseline_is_picked_on_tuning_seeds_and_judged_on_the_others(tmp_path):
    spec = {"description": "grid", "seeds": [0, 1, 2], "tune": {"arms": ["g2@x", "g4@x"], "seeds": [6, 7]},
            "arms": {"p3o@x": {"objective.name": "p3o"},
                     "g2@x": {"objective.name": "grpo", "objective.options": {"eps_low": 0.2, "eps_high": 0.2}},
                     "g4@x": {"objective.name": "grpo", "objective.options": {"eps_low": 0.4, "eps_high": 0.4}}}}
    f = tmp_path / "grid.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    exp = load_experiment(str(f))
    assert exp.runs == [(a, s) for a in ("p3o@x", "g2@x", "g4@x") for s in (0, 1, 2)] + [("g2@x", 6), ("g2@x", 7),
                                                                                           ("g4@x", 6), ("g4@x", 7)]
    # g4 wins on the tuning seeds (0.30 against 0.25) though g2 is far ahead on the comparison seeds
    exp_dir = tmp_path / "runs" / "grid"
    exp_dir.mkdir(parents=True)
    (exp_dir / "experiment.yaml").write_text(yaml.safe_dump({**spec, "commit": "abc"}, sort_keys=False))
    finals = {"p3o@x": [0.40, 0.42, 0.41], "g2@x": [0.90, 0.90, 0.90], "g4@x": [0.30, 0.35, 0.31]}
    for arm, fs in finals.items():
        for seed, v in zip((0, 1, 2), fs):
            _fake_run(exp_dir, arm, seed, 0.2, v)
    for arm, v in (("g2@x", 0.25), ("g4@x", 0.30)):
        for seed in (6, 7):
            _fake_run(exp_dir, arm, seed, 0.2, v)
    text = write_report(tmp_path / "runs", tmp_path / "report", ["grid"]).read_text()
    assert "**Tuned baseline:** g4@x, the best of the grid by mean primary score on the tuning seeds [6, 7] (g2@x 0.250, g4@x 0.300)" in text
    assert "9 runs (and 4 tuning runs on seeds [6, 7])" in text
    # the table and the comparisons see seeds 0-2 only: g4's primary score is mean(0.30, 0.35, 0.31)
    assert f"| g4@x | 0.200 | {(0.30 + 0.35 + 0.31) / 3:.3f} ± " in text
    d = [0.40 - 0.30, 0.42 - 0.35, 0.41 - 0.31]
    assert f"p3o@x − g4@x = {sum(d) / 3:+.3f}" in text and "over 3 seeds" in text and "(g4@x is the tuned baseline)" in text
    assert "`trustbatch lab report grid --runs" in text
    spec["tune"]["seeds"] = [1, 6]
    f.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=r"tuning seeds \[1\] are also comparison seeds"):
        load_experiment(str(f))
    for bad, why in (({"arms": ["nope"], "seeds": [6]}, r"run arms of the experiment \(nope\)"), (["g2@x"], "'tune' must be"),
                     ({"arms": ["g2@x"]}, "'tune' must be"), ({"arms": ["g2@x"], "seeds": [6, 6]}, r"distinct integers, got \[6, 6\]"),
                     ({"arms": ["g2@x", "g2@x"], "seeds": [6]}, "lists an arm twice")):
        spec["tune"] = bad
        f.write_text(yaml.safe_dump(spec))
        with pytest.raises(UserError, match=why):
            load_experiment(str(f))


def test_bases_build_in_worker_processes_once_per_distinct_base(tmp_path, monkeypatch):
    """jobs=2: the distinct bases (one per seed, shared by three arms, and one foreign base) are built by worker
    processes into the cache, whole, and a second call finds them all cached."""
    from trustbatch.lab.runner import build_shared_base

    import trustbatch.policy.base as base_mod

    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))  # the spawned workers inherit it
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    spec = {"description": "tiny", "common": common, "seeds": [0, 1],
            "arms": {"onpolicy": {}, "p3o@T1.2": {"objective.name": "p3o", "rollout.temperature": 1.2},
                     "p3o@foreign": {"objective.name": "p3o", "rollout.foreign_fraction": 0.5,
                                     "rollout.foreign_model": {"hidden": 48, "seed": 5}}}}
    f = tmp_path / "tiny_bases.yaml"
    f.write_text(yaml.safe_dump(spec))
    exp = load_experiment(str(f))

    class _Quiet:
        def print(self, *a, **k):
            pass

    def _not_here(*a, **k):
        raise AssertionError("jobs=2 builds in worker processes, not in the caller")

    monkeypatch.setattr(base_mod, "sft", _not_here)  # the spawned workers import their own, unpatched
    build_shared_base(exp, _Quiet(), jobs=2)
    monkeypatch.undo()
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "base"
    built = sorted(p for p in root.iterdir())
    # seed 0's base, seed 1's base (three arms share each) and the one foreign base (its mapping fixes its seed)
    assert len(built) == 3 and all((p / "config.json").is_file() and (p / "model.safetensors").is_file() for p in built)
    mtimes = [(p / "model.safetensors").stat().st_mtime_ns for p in built]
    build_shared_base(exp, _Quiet(), jobs=2)  # all cached: nothing is written again
    assert sorted(root.iterdir()) == built and [(p / "model.safetensors").stat().st_mtime_ns for p in built] == mtimes
    # a run's own lookup finds the same folder as the workers wrote (the cache key does not depend on the builder)
    from trustbatch.config import load_config
    from trustbatch.recipes.build import prepare_run

    _, _, pool, source = prepare_run(load_config(None, exp.overrides("p3o@T1.2", 1)))
    pool.close()
    assert source.endswith("(cached)") and any(str(p) in source for p in built)


def test_covered_seconds_counts_overlapping_calls_once():
    from trustbatch.lab.calls import covered_seconds

    # union worked by hand: [0, 20] and [30, 41] -> 20 + 11; the reversed interval is ignored
    assert covered_seconds([(30, 40), (0, 10), (5, 20), (40, 41), (50, 45)]) == 31.0
    assert covered_seconds([(0, 5), (1, 2)]) == 5.0
    assert covered_seconds([]) == 0.0


def test_calls_record_every_lab_run_and_time_counts_overlaps_once(tmp_path, monkeypatch):
    """A second `lab run` on the same experiment (seeds added later, a resume) keeps the first call's seeds and
    commit in calls.jsonl and experiment.yaml; wall_s.txt is the time the calls cover, not their sum."""
    import trustbatch.lab.runner as runner
    from trustbatch.lab.calls import load_calls, record_call

    monkeypatch.setattr(runner, "build_shared_base", lambda *a, **k: None)
    spec = {"description": "t", "seeds": [0], "arms": {"onpolicy": {}}}
    f = tmp_path / "acc.yaml"
    f.write_text(yaml.safe_dump(spec))
    exp_dir = tmp_path / "runs" / "acc"
    for seed in (0, 1):
        _fake_run(exp_dir, "onpolicy", seed, 0.2, 0.3)  # finished: nothing to run
    (exp_dir / "wall_s.txt").write_text("4128\n")  # a call from before calls.jsonl: its summed 68.8 min
    for seeds in ([0], [1]):
        run_experiment(load_experiment(str(f), seeds=seeds), tmp_path / "runs", jobs=1)
    calls = load_calls(exp_dir)
    assert calls[0] == {"legacy_wall_s": 4128.0}
    assert [c["seeds"] for c in calls[1:]] == [[0], [1]] and all(c["runs_started"] == 0 for c in calls[1:])
    assert yaml.safe_load((exp_dir / "experiment.yaml").read_text())["seeds"] == [0, 1]
    assert 4128 <= float((exp_dir / "wall_s.txt").read_text()) < 4128 + 30
    # two calls that overlapped (two seeds run at once in two shells): 100-160 s and 130-250 s cover 150 s, not 180
    d = tmp_path / "overlap"
    record_call(d, {"start": 100.0, "end": 160.0, "build_s": 20.0, "seeds": [0], "commit": "a", "command": "c0"})
    assert record_call(d, {"start": 130.0, "end": 250.0, "build_s": 0.0, "seeds": [1], "commit": "b", "command": "c1"}) == 150.0
    assert (d / "wall_s.txt").read_text() == "150\n"
    from trustbatch.lab.report.provenance import calls_line, experiment_time

    assert experiment_time(d, load_calls(d)) == "; the whole experiment took 2.5 min wall-clock on 2 cores (base builds 0.3 min of it; calls overlapped for 0.5 min, counted once)."
    assert "seeds [0] at commit `a`" in calls_line(load_calls(d)) and "seeds [1] at commit `b`" in calls_line(load_calls(d))
    (d / "calls.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="calls.jsonl:1 is not JSON"):
        load_calls(d)


def test_lab_run_arms_trains_only_the_named_arms_and_records_them(tmp_path, monkeypatch):
    """`lab run --arms` visits only the named arms (a tuning-grid arm on its tuning seeds too), says so in the
    call's command, and keeps every arm in experiment.yaml; unknown and pre-flight-only arms are one-line errors."""
    from typer.testing import CliRunner

    import trustbatch.lab.runner as runner
    from trustbatch.cli import app
    from trustbatch.lab.calls import load_calls

    visited = []
    monkeypatch.setattr(runner, "build_shared_base", lambda *a, **k: None)
    # None: "already finished"; what matters is which (arm, seed) the runner asks for
    monkeypatch.setattr(runner, "_command", lambda exp, arm, seed, run_dir: visited.append((arm, seed)))
    grpo = {"objective.name": "grpo"}
    spec = {"description": "t", "seeds": [0, 1], "preflight_only": ["probe@x"],
            "tune": {"arms": ["g1@x", "g2@x"], "seeds": [7]},
            "arms": {"onpolicy": {}, "p3o@x": {"objective.name": "p3o"}, "g1@x": grpo,
                     "g2@x": {**grpo, "objective.options": {"eps_low": 0.4, "eps_high": 0.4}}, "probe@x": grpo}}
    f = tmp_path / "sel.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = tmp_path / "runs"
    r = CliRunner().invoke(app, ["lab", "run", str(f), "--out", str(out), "--jobs", "1", "--arms", "p3o@x, g1@x"])
    assert r.exit_code == 0, r.output
    assert visited == [("p3o@x", 0), ("p3o@x", 1), ("g1@x", 0), ("g1@x", 1), ("g1@x", 7)]
    call = load_calls(out / "sel")[-1]
    assert call["command"].endswith("--arms p3o@x,g1@x") and call["arms"] == ["g1@x", "p3o@x"]
    assert list(yaml.safe_load((out / "sel" / "experiment.yaml").read_text())["arms"]) == list(spec["arms"])
    visited.clear()
    started = time.monotonic()
    r = CliRunner().invoke(app, ["lab", "run", str(f), "--out", str(out), "--jobs", "1"])
    took = time.monotonic() - started
    assert r.exit_code == 0, r.output
    assert len(visited) == 4 * 2 + 2 * 1  # every run arm on seeds 0-1, the grid on seed 7
    # a call of seconds says so in seconds (it read "0.0 min"), within the time the call took
    said = re.search(r"sel: 10 runs done, 0 failed, (\d+(?:\.\d)?) s$", r.output.strip())
    assert said and float(said[1]) <= took + 0.05, r.output
    exp = load_experiment(str(f))
    with pytest.raises(UserError, match="has no arm 'nope'; its run arms are onpolicy, p3o@x, g1@x, g2@x$"):
        exp.select(["p3o@x", "nope"])
    with pytest.raises(UserError, match="arm 'probe@x' of 'sel' is pre-flight only"):
        exp.select(["probe@x"])
    with pytest.raises(UserError, match="--arms names no arm"):
        exp.select([])


def test_cost_table_counts_own_calls_against_the_budget_and_shows_reused_runs_apart(tmp_path):
    """Each experiment's wall-clock is the union of its calls (worked by hand), a reused reference run (its config
    names another experiment's folder) is counted apart, a run with no config is of unknown origin, base builds
    are "not recorded" unless a call recorded them, and the 40-minute verdict follows the measured time."""
    from trustbatch.lab.calls import record_call
    from trustbatch.lab.report import experiment_cost

    runs = tmp_path / "runs"

    def run(exp, arm, seed, wall, home):
        _fake_run(runs / exp, arm, seed, 0.2, 0.3)
        (runs / exp / arm / f"seed{seed}" / "summary.json").write_text(json.dumps({"steps": 100, "wall_s": wall}))
        if home is not None:
            (runs / exp / arm / f"seed{seed}.yaml").write_text(f"run_dir: /lab/{home}/{arm}/seed{seed}\n")
        (runs / exp / "experiment.yaml").write_text("arms: {onpolicy: {}}\n")

    run("shift", "p3o@x", 0, 300.0, "shift")
    run("shift", "p3o@x", 1, 420.0, "shift")
    run("shift", "onpolicy", 0, 150.0, "reference")  # trained in another experiment, copied here
    run("shift", "onpolicy", 1, 150.0, None)  # copied without its config
    # [0, 1500] and [1000, 2700] cover 2700 s = 45 min, not their 50-minute sum; builds 60 + 30 s
    record_call(runs / "shift", {"start": 0.0, "end": 1500.0, "build_s": 60.0, "runs_started": 1})
    record_call(runs / "shift", {"start": 1000.0, "end": 2700.0, "build_s": 30.0, "runs_started": 1})
    assert experiment_cost(runs / "shift") == {"own": 2, "reused": 1, "reused_s": 150.0, "unknown": 1, "wall_s": 2700.0,
                                               "build_s": 90.0, "builds_partial": False, "run_s": (300.0, 420.0),
                                               "preflight_s": False}
    (runs / "shift" / "preflight.json").write_text(json.dumps({"arms": [], "start": 100.0, "end": 1300.0}))
    run("old", "onpolicy", 0, 60.0, "old")  # run before calls.jsonl: wall_s.txt is the time, builds unrecorded
    (runs / "old" / "wall_s.txt").write_text("2400\n")
    run("mixed", "onpolicy", 0, 60.0, "mixed")  # a legacy call, then a recorded one: 600 + 300 s
    (runs / "mixed" / "wall_s.txt").write_text("600\n")
    record_call(runs / "mixed", {"start": 0.0, "end": 300.0, "build_s": 12.0, "runs_started": 1})
    run("bare", "onpolicy", 0, 60.0, "bare")  # neither recorded
    (runs / "probe").mkdir()
    (runs / "probe" / "experiment.yaml").write_text("arms: {onpolicy: {}}\n")  # pre-flight only: no row
    text = write_report(runs, tmp_path / "report", figures="none").read_text()
    # the pre-flight's own 20 minutes (its recorded start and end) in its column
    assert ("| shift | 2 (+1 of unknown origin: no config) | 1 (2.5 min) | 45.0 min | 1.5 min | 20.0 min | 5.0–7.0 min "
            "| **no** (5.0 min over) |") in text
    (runs / "old" / "preflight.json").write_text(json.dumps({"arms": []}))  # from before pre-flights recorded a time
    text = write_report(runs, tmp_path / "report", figures="none").read_text()
    assert "| old | 1 | 0 | 40.0 min | not recorded | not recorded | 1.0–1.0 min | yes |" in text  # at the budget is within it
    assert "| mixed | 1 | 0 | 15.0 min | 0.2 min (earlier calls: not recorded) | none | 1.0–1.0 min | yes |" in text
    assert "| bare | 1 | 0 | not recorded | not recorded | none | 1.0–1.0 min | not measured |" in text
    assert "| probe |" not in text and text.count("## Cost against the 40-minute budget") == 1


_SCRIPT = """
import json, sys
from pathlib import Path
import trustbatch.lab.runner as runner
from trustbatch.lab import load_experiment, run_experiment

out, tiny = Path(sys.argv[2]), json.loads(sys.argv[3])
runner.build_shared_base = lambda *a, **k: None
# each run: a real tiny `trustbatch train` with far more rounds than the test waits for
runner._command = lambda exp, arm, seed, run_dir: (run_dir.mkdir(parents=True), [
    "train", *tiny, "train.steps=100000", "eval.every=100000", "checkpoint_every=100000", f"run_dir={run_dir}"])[1]


class Recorded(runner.Run):  # the real launcher, which also writes each run's pid where the test can read it
    def __init__(self, argv, log):
        super().__init__(argv, log)
        (out / ("pid" + Path(log).stem[len("seed"):])).write_text(str(self.pid))


runner.Run = Recorded
if __name__ == "__main__":
    try:
        run_experiment(load_experiment(sys.argv[1]), out, jobs=2)
    except KeyboardInterrupt as e:
        (out / "interrupt.txt").write_text(str(e))
        raise
"""


def _start_runner(tmp_path):
    """The runner of ``_SCRIPT`` with two real tiny runs going: (its process, its output folder, the runs' pids)."""
    import subprocess
    import sys
    import time

    f = tmp_path / "term.yaml"
    f.write_text(yaml.safe_dump({"description": "t", "seeds": [0, 1], "arms": {"onpolicy": {}}}))
    script = tmp_path / "runner_script.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "runs"
    env = dict(os.environ, TRUSTBATCH_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, str(script), str(f), str(out), json.dumps(TINY)], env=env)
    logs = [out / "term" / "onpolicy" / f"seed{s}.log" for s in (0, 1)]
    deadline = time.time() + 180
    try:
        while not all(log.exists() and "run directory:" in log.read_text() for log in logs):
            assert time.time() < deadline and proc.poll() is None, "the runs never started"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        raise
    return proc, out, [int((out / f"pid{s}").read_text()) for s in (0, 1)]


def test_sigterm_stops_the_runs_with_the_runner_and_records_the_call(tmp_path):
    """A runner killed with SIGTERM (a scheduler, `kill`) must not leave its runs going as orphans.

    The runs are real ``trustbatch train`` processes started by ``lab.launch`` (forked from its warm server, not
    children of the runner), stopped once each has written its first lines to its own log."""
    import signal

    from trustbatch.lab.calls import load_calls

    proc, out, pids = _start_runner(tmp_path)
    for pid in pids:
        os.kill(pid, 0)  # running
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
    for pid in pids:  # gone: waited for by the runner, so not even a zombie is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    call = load_calls(out / "term")[-1]
    assert call["interrupted"] is True and call["runs_started"] == 2
    # the one line the CLI prints says how to resume (a bare KeyboardInterrupt used to print "trustbatch: " alone)
    said = (out / "interrupt.txt").read_text()
    assert said.startswith("interrupted;") and "the same `trustbatch lab run` command resumes" in said, said


def test_kill9_of_the_runner_leaves_no_forkserver_no_run_and_no_worker(tmp_path):
    """SIGKILL gives the runner no chance to stop anything: its forkserver, the runs forked from it and their reward
    workers must each see their parent die and stop (``processes.die_with_parent``), found by walking /proc."""
    import signal

    from runproc import descendants, outlived

    proc, _out, pids = _start_runner(tmp_path)
    tree = descendants(proc.pid)
    assert set(pids) <= set(tree), f"expected the forkserver, 2 runs and their workers: {tree}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert outlived(tree) == [], "processes outlived the lab runner killed with SIGKILL"


def test_cli_says_a_bare_interrupt_in_one_line(monkeypatch, capsys):
    import trustbatch.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130
    assert capsys.readouterr().err == "trustbatch: interrupted\n"


def test_a_lab_run_takes_the_arguments_of_trustbatch_train():
    """The runner's three shapes of call (``runner._command``, the tests' overrides), parsed as the CLI would."""
    from trustbatch.lab.launch import train_arguments

    assert train_arguments(["train", "--config", "a/seed0.yaml"]) == {
        "config": "a/seed0.yaml", "overrides": None, "resume": None}
    assert train_arguments(["train", "--resume", "a/seed0"]) == {"config": None, "overrides": None, "resume": "a/seed0"}
    assert train_arguments(["train", "train.steps=2", "-c", "x.yaml", "seed=3"]) == {
        "config": "x.yaml", "overrides": ["train.steps=2", "seed=3"], "resume": None}
    with pytest.raises(ValueError, match="trustbatch sft"):
        train_arguments(["sft", "--out", "d"])


def test_launched_run_takes_the_callers_environment_directory_and_exit_code(tmp_path, monkeypatch):
    """``lab.launch.Run`` forks from a server started earlier: the run must still see the environment and working
    directory of the moment it is launched, write its output to its log, and exit with the CLI's code."""
    from trustbatch.lab.launch import Run

    monkeypatch.chdir(tmp_path)
    bad = Run(["train", "train.stepz=1"], tmp_path / "bad.log")  # also starts the server, if no test did yet
    assert bad.wait(timeout=300) != 0
    assert "unknown config key 'train.stepz'" in (tmp_path / "bad.log").read_text()
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "late_cache"))  # set after the server started
    ok = Run(["train", *TINY, "train.steps=1", "eval.every=1", "run_dir=rel_run"], Path("ok.log"))
    assert ok.wait(timeout=300) == 0, (tmp_path / "ok.log").read_text()
    assert "done in" in (tmp_path / "ok.log").read_text()
    assert json.loads((tmp_path / "rel_run" / "summary.json").read_text())["steps"] == 1
    assert any((tmp_path / "late_cache").rglob("*.safetensors"))


_SLOW_STOP = """
import os, subprocess, sys, time
import trustbatch.lab.runner as runner


class SlowStop:  # a run that takes 3 s to stop after SIGTERM (a train run writing its last state): > RESEND_S
    def __init__(self):
        code = "import signal,time\\nsignal.signal(signal.SIGTERM, lambda *a: (time.sleep(3), exit(130)))\\ntime.sleep(600)"
        self._p = subprocess.Popen([sys.executable, "-c", code])
        self.pid = self._p.pid

    def poll(self):
        return self._p.poll()

    def terminate(self):
        self._p.terminate()

    def kill(self):
        self._p.kill()

    def wait(self, timeout=None):
        try:
            return self._p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError


def run_all(exp, root, todo, jobs, console, tally):
    tally.running.append((SlowStop(), "arm", 0))
    tally.started += 1
    open(os.environ["READY"], "w").write(str(tally.running[0][0].pid))
    time.sleep(600)


runner.build_shared_base = lambda *a, **k: None
runner._run_all = run_all
from trustbatch.cli import main
sys.argv = ["trustbatch", "lab", "run", "clip", "--out", os.environ["OUT"], "--seeds", "0"]
main()
"""


def test_sigterm_to_the_command_waits_for_a_slow_run_to_stop(tmp_path):
    """Through ``trustbatch lab run`` (``cli.main``, under its ``interrupt_guard``): the guard re-delivers SIGTERM every
    2 s, and the lab's own handler raised on each one, cutting short its wait for a run that takes 3 s to stop: the
    run was left going, the call unrecorded, the resume line lost."""
    import signal
    import subprocess
    import sys
    import time

    from trustbatch.lab.calls import load_calls

    ready = tmp_path / "ready"
    env = dict(os.environ, OUT=str(tmp_path / "out"), READY=str(ready), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_STOP], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not ready.exists():
        assert time.time() < deadline and proc.poll() is None, "the stand-in run never started"
        time.sleep(0.1)
    time.sleep(0.2)
    child = int(ready.read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err[-2000:]
    with pytest.raises(ProcessLookupError):  # stopped and waited for
        os.kill(child, 0)
    assert load_calls(tmp_path / "out" / "clip")[-1]["interrupted"] is True
    assert "the same `trustbatch lab run` command resumes" in err, err[-2000:]
