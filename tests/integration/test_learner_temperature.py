"""``objective.temperature``: π_θ's temperature in the loss. ``rollout`` scores the policy at the sampling
temperature, as TRL and verl do, so a fresh batch sampled at T = 0.7 is on-policy (ratio 1); the default 1 scores
the policy itself, so that batch is off-policy data (the P3O paper's temperature shift). Reference: the model's logits
divided by T, log-softmaxed in float64 by hand, and the engine's own log-probs of what it sampled."""

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.recipes.build import build_parts, prepare_run

SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=8", "rollout.temperature=0.7",
         "rollout.max_new_tokens=12", "objective.name=grpo", "threads=1"]


def _by_hand(model, packed, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each completion token, float64, [B, C] (0 outside the completions)."""
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids).logits.double()
    C = packed.response_mask.shape[1]
    logp = torch.log_softmax(logits[:, -C - 1:-1] / temperature, dim=-1)
    picked = logp.gather(-1, packed.input_ids[:, -C:, None])[..., 0]
    return picked * packed.response_mask


@pytest.mark.parametrize("setting, learner_t, extra", [("rollout", 0.7, []), (1.0, 1.0, []),
                                                       ("rollout", 0.7, ["train.padding_free=true"])])
def test_the_loss_scores_the_policy_at_its_temperature(tmp_path, monkeypatch, setting, learner_t, extra):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, SMALL + extra + [f"objective.temperature={setting}", f"run_dir={tmp_path / 'run'}"])
    task, policy, pool, _ = prepare_run(cfg)
    parts = build_parts(cfg, task, policy, pool).parts
    try:
        batch = parts.source.next_batch(parts.learner.version)
        m = batch.packed.response_mask
        got = parts.learner.logprobs(batch).double() * m
        want = _by_hand(policy.model.eval(), batch.packed, learner_t)
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
        # the engine sampled at 0.7: at the learner's 0.7 its log-probs are the learner's (on-policy), at 1 not
        gap = float(((got - batch.behavior_logprobs.double()) * m).abs().max())
        assert (gap < 1e-5) == (setting == "rollout"), gap
        metrics = parts.learner.train_on(batch)
        if setting == "rollout":
            assert metrics["clip_fraction"] == 0.0 and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        else:
            assert metrics["ratio_max"] > 1.05  # the temperature shift
    finally:
        parts.source.close()
        pool.close()
