"""A lab run's config file keeps the defaults that follow the data: the runner writes every key to ``seedN.yaml``
and trains with ``--config``, so a GSM8K arm's ``rollout.max_new_tokens`` read as set at its default of 8 (every
answer cut) where ``trustbatch train data=gsm8k`` gets GSM8K's budget. The reference: the budget rule by hand, 512
tokens capped at half the model's 512-token context."""

import yaml

from trustbatch.config import load_config
from trustbatch.lab.experiment import Experiment
from trustbatch.lab.runner import _command


def test_a_data_file_arm_gets_the_answer_budget_and_a_set_budget_stays(tmp_path, shared_dir):
    data, model = shared_dir / "data" / "gsm8k" / "train.jsonl", shared_dir / "models" / "stories260K-hf"
    common = {"data.train": str(data), "model.path": str(model)}
    exp = Experiment(name="x", description="", seeds=[0],
                     arms={"auto": dict(common), "set": {**common, "rollout.max_new_tokens": 12}})
    for arm, want in (("auto", min(512, 512 // 2)), ("set", 12)):
        cmd = _command(exp, arm, 0, tmp_path / arm / "seed0")
        written = tmp_path / arm / "seed0.yaml"
        assert cmd == ["train", "--config", str(written)]
        assert yaml.safe_load(written.read_text())["rollout"]["max_new_tokens"] == want, arm
        assert load_config(str(written)).rollout.max_new_tokens == want


def test_the_preflight_probes_a_data_file_arm_at_its_runs_budget(tmp_path, shared_dir, monkeypatch):
    """The pre-flight measures a step the arm's run really takes: it probed a GSM8K arm at 8 new tokens while the run
    trains at 256 (the reviewer's: response_length 8.0)."""
    import pytest

    import trustbatch.lab.preflight as preflight
    from trustbatch.errors import UserError

    data, model = shared_dir / "data" / "gsm8k" / "train.jsonl", shared_dir / "models" / "stories260K-hf"
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"description": "", "seeds": [0], "arms": {
        "auto": {"data.train": str(data), "model.path": str(model)}}}))
    seen = []

    def probe(cfg, arm, console=None):
        seen.append(cfg.rollout.max_new_tokens)
        raise UserError("not probed here")

    monkeypatch.setattr(preflight, "probe_arm", probe)
    with pytest.raises(UserError, match="no arm could be measured"):
        preflight.run_preflight(str(tmp_path / "x.yaml"), tmp_path / "out")
    assert seen == [256]


def test_nested_sections_in_an_experiment_merge_key_by_key_as_a_config_file_does(tmp_path):
    """``common: {rollout: {temperature: 0.6}}`` and an arm's ``{rollout: {precision: bfloat16}}``: set whole, the
    arm's section replaced common's and LAB_COMMON's (the arm trained at T = 1.0, 250 rounds, no diagnostics)."""
    from trustbatch.lab.experiment import load_experiment

    nested, dotted = tmp_path / "nested.yaml", tmp_path / "dotted.yaml"
    nested.write_text(yaml.safe_dump({"seeds": [0], "common": {"rollout": {"temperature": 0.6}},
                                      "arms": {"a": {"rollout": {"precision": "bfloat16"},
                                                     "objective": {"name": "grpo", "options": {"eps_low": 0.3}}}}}))
    dotted.write_text(yaml.safe_dump({"seeds": [0], "common": {"rollout.temperature": 0.6},
                                      "arms": {"a": {"rollout.precision": "bfloat16", "objective.name": "grpo",
                                                     "objective.options": {"eps_low": 0.3}}}}))
    got, want = (load_config(None, load_experiment(str(p)).overrides("a", 0)) for p in (nested, dotted))
    assert got == want
    # rollout.foreign_model is a name or a mapping, set whole (split into keys it was refused as "not a section")
    named = tmp_path / "foreign.yaml"
    named.write_text(yaml.safe_dump({"seeds": [0], "common": {"rollout": {"foreign_fraction": 0.5,
                                                                          "foreign_model": "initial"}},
                                     "arms": {"b": {"rollout.foreign_model": {"hidden": 96, "seed": 1}}}}))
    assert load_config(None, load_experiment(str(named)).overrides("b", 0)).rollout.foreign_model == \
        {"hidden": 96, "seed": 1}
    assert (got.rollout.temperature, got.rollout.precision, got.train.steps, got.train.diagnostics) == \
        (0.6, "bfloat16", 100, True)


def test_an_arm_name_that_is_not_one_folder_is_refused(tmp_path):
    """``p3o@1/2`` trained into p3o@1/2/seed0, which the archive's glob (ARM/seedK) never found: its runs were dropped."""
    import pytest

    from trustbatch.errors import UserError
    from trustbatch.lab.experiment import load_experiment

    (tmp_path / "e.yaml").write_text(yaml.safe_dump({"arms": {"p3o@1/2": {}, "grpo@1/2": {}}}))
    with pytest.raises(UserError, match="arm name '(p3o|grpo)@1/2' would not be one folder"):
        load_experiment(str(tmp_path / "e.yaml"))


def test_arms_whose_bases_are_one_model_build_it_once(tmp_path):
    """A LoRA arm and a full fine-tuning arm of one seed train from one base (the cache's key): it was built twice,
    by two workers at once. A seed of its own is another base."""
    from trustbatch.lab.runner import base_builds

    exp = Experiment(name="x", description="", seeds=[0, 1],
                     arms={"full": {"model.sft_steps": 5}, "lora": {"model.sft_steps": 5, "model.lora": {"r": 4}}})
    builds = [b[:2] for b in base_builds(exp)[0]]
    assert len(builds) == 2 and {seed for _, seed in builds} == {0, 1}


def test_an_interrupt_while_bases_build_ends_the_builders_at_once():
    """Ctrl-C or SIGTERM (``lab run`` turns it into KeyboardInterrupt) while bases build: the queued builds are
    cancelled and the running builders end (the runner waited for every queued base, 26 s for six small ones)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    from trustbatch.lab.runner import _stop_builds

    ex = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    futures = [ex.submit(time.sleep, 60) for _ in range(5)]
    while not any(f.running() for f in futures):
        time.sleep(0.05)
    procs = list(ex._processes.values())
    deadline = time.monotonic() + 10
    _stop_builds(ex)
    # polled, not joined: the executor's own thread reaps its processes too
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in procs)
    assert sum(f.cancelled() for f in futures) >= 2  # the ones not yet handed to a worker
