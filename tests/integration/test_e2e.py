"""End-to-end smoke runs of ``trustbatch train`` with a tiny model: run directory, finite metrics, resume."""

import json
import math

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.recipes import train

from tiny import TINY



@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))


def _records(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("objective", ["p3o", "grpo"])
def test_smoke_run_writes_everything_with_finite_metrics(tmp_path, cache, objective):
    run = tmp_path / "run"
    cfg = load_config(None, TINY + ["train.steps=3", f"run_dir={run}", f"objective.name={objective}"])
    summary = train(cfg)
    for name in ("config.yaml", "metrics.jsonl", "plot.png", "summary.json"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_000002", "step_000003"]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"):
        assert (ckpts[-1] / f).is_file(), f
    assert not list(run.rglob(".tmp-*")) and not list(run.glob(".*.tmp"))
    recs = _records(run)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for r in recs:
        for k, v in r.items():
            assert isinstance(v, (int, float)) and math.isfinite(v), (k, v)
    steps = recs[1:]
    for key in ("reward_mean", "ess", "kl_behavior", "clip_fraction", "entropy", "response_length", "tokens_per_s", "loss"):
        assert all(key in r for r in steps), key
    assert "cap_fraction" in steps[0] if objective == "p3o" else True
    assert all("heldout_accuracy" in recs[i] for i in (0, 2, 3))
    # on-policy in float32: the first step's ESS is 1 up to float error
    assert abs(steps[0]["ess"] - 1.0) < 1e-6
    assert summary["final_heldout_accuracy"] == recs[-1]["heldout_accuracy"]


def test_resume_continues_from_last_checkpoint(tmp_path, cache):
    run = tmp_path / "run"
    train(load_config(None, TINY + ["train.steps=2", f"run_dir={run}"]))
    summary = train(resume=str(run), overrides=["train.steps=4"])
    recs = _records(run)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert summary["steps"] == 4
    assert (run / "checkpoints" / "step_000004" / "trainer_state.pt").is_file()


def test_default_base_is_cached_and_reused(tmp_path, cache):
    from trustbatch.recipes import prepare_run

    cfg = load_config(None, TINY)
    _, _, _, first = prepare_run(cfg)
    _, _, _, second = prepare_run(cfg)
    assert first.endswith("(built now)") and second.endswith("(cached)")


def test_dapo_with_dynamic_sampling_and_overlong_shaping(tmp_path, cache):
    run = tmp_path / "run"
    cfg = load_config(None, TINY + ["train.steps=2", f"run_dir={run}", "objective.name=dapo",
                                    "rollout.dynamic_sampling=true", "rollout.overlong_cache=2"])
    train(cfg)
    recs = _records(run)[1:]
    assert all("groups_dropped" in r for r in recs)
    for r in recs:
        if "skipped_step" not in r:
            # kept groups never exceed the target, and the batch holds whole groups only
            assert r["num_tokens"] > 0


def test_skipped_last_rounds_still_checkpoint_and_evaluate_the_trained_policy(tmp_path, cache):
    """Dynamic sampling skips rounds 2 and 3 (no informative group): round 2, a checkpoint round, still saves, and
    round 3, the last, saves and evaluates. Before, the run ended with round 0's checkpoint alone, and its summary
    and `trustbatch export` gave a policy older than the one round 1 trained."""
    import scorers_for_tests

    run = tmp_path / "run"
    scorers_for_tests.informative_first.left = 16  # TINY's first round: 4 prompts x 4 samples
    summary = train(load_config(None, TINY + [
        "train.steps=3", "checkpoint_every=2", "eval.every=100", f"run_dir={run}", "reward.workers=0",
        "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=1",
        "reward.functions=[{name: 'scorers_for_tests:informative_first'}]"]))
    recs = _records(run)
    assert [("skipped_step" in r) for r in recs[1:]] == [False, True, True]
    # checkpoint_keep (2) keeps the newest two: round 0's only, before
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_000002", "step_000003"]
    assert "heldout_accuracy" in recs[3] and "heldout_accuracy" not in recs[2]
    assert summary["final_heldout_accuracy"] == recs[3]["heldout_accuracy"]


def test_lora_dropout_training_does_not_depend_on_how_often_it_evaluates(tmp_path, cache):
    """With dropout in the policy (LoRA dropout 0.1), decoupled PPO's proximal snapshot and the logged ratios are
    no-grad passes of the learner: in train mode (left so by the previous step) they were dropout samples, drawing
    from the global random stream, so eval.every (resumable, documented as never moving training) changed the
    trained weights, and a resume did too. Now they run in eval mode: the same weights, bit for bit."""
    from safetensors.torch import load_file

    weights = {}
    for every in (2, 100):
        run = tmp_path / f"every{every}"
        # the shipped base, whose groups are informative in every round (TINY's own base gives rounds 2-4 no gradient)
        train(load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=4", "reward.workers=0",
                                 "eval.samples_per_prompt=1", "train.steps=4", f"eval.every={every}", f"run_dir={run}",
                                 "checkpoint_every=100", "objective.name=decoupled_ppo",
                                 "model.lora={r: 4, alpha: 8, dropout: 0.1}"]))
        assert all(r["grad_norm"] > 0 for r in _records(run)[1:])
        weights[every] = load_file(str(run / "checkpoints" / "step_000004" / "adapter_model.safetensors"))
    assert weights[2].keys() == weights[100].keys() and weights[2]
    assert all(torch.equal(weights[2][k], weights[100][k]) for k in weights[2])


def test_train_from_a_local_hf_model_directory(tmp_path, cache, shared_dir):
    run = tmp_path / "run"
    model = shared_dir / "models" / "stories260K-hf"
    cfg = load_config(None, TINY + ["train.steps=1", f"run_dir={run}", f"model.path={model}"])
    summary = train(cfg)
    assert summary["final_heldout_accuracy"] is not None
    ck = run / "checkpoints" / "step_000001"
    assert (ck / "model.safetensors").is_file() and (ck / "tokenizer.json").is_file()
    recs = _records(run)
    assert all(math.isfinite(v) for r in recs for v in r.values())


def test_weak_teacher_corrupts_a_fixed_fraction_with_plausible_answers():
    from trustbatch.policy.base import weak_teacher

    demos = [(f"q{i}", f" {i % 37}") for i in range(4000)]
    out = weak_teacher(demos, 0.25, seed=0)
    assert [p for p, _ in out] == [p for p, _ in demos]
    changed = sum(a != b for (_, a), (_, b) in zip(out, demos))
    # a replaced answer equals the original 1/37 of the time, so ~0.25·36/37 of rows change
    assert abs(changed / 4000 - 0.25 * 36 / 37) < 0.03
    assert {c for _, c in out} <= {c for _, c in demos}
    assert weak_teacher(demos, 0.25, seed=0) == out and weak_teacher(demos, 0.0, seed=0) == demos


def test_evaluation_does_not_move_the_training_streams(tmp_path, cache):
    """eval.every may change on resume, so evaluating more or less often must leave training bit-identical."""
    from safetensors.torch import load_file

    runs = {}
    for every in (1, 100):
        run = tmp_path / f"every{every}"
        train(load_config(None, TINY + ["train.steps=3", f"eval.every={every}", "checkpoint_every=100", "threads=1",
                                        "reward.workers=0", f"run_dir={run}"]))
        runs[every] = run
    trained = {e: [{k: v for k, v in r.items() if not k.startswith("heldout") and k not in ("tokens_per_s", "step_s", "rollout_s")}
                   for r in _records(run) if r["step"] > 0] for e, run in runs.items()}
    assert trained[1] == trained[100]
    a, b = (load_file(str(runs[e] / "checkpoints" / "step_000003" / "model.safetensors")) for e in (1, 100))
    assert all(torch.equal(a[k], b[k]) for k in a)
