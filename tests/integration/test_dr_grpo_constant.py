"""Dr.GRPO's aggregation in training divides by the generation budget, not by the round's longest completion."""

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.recipes.build import build_parts, prepare_run

BUDGET = 24
# the shipped base (the default model and task) ends most chain_sum answers with EOS well within 24 tokens
SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=8"]


@pytest.mark.parametrize("options, constant", [("{aggregation: seq_mean_token_sum}", BUDGET),
                                               ("{aggregation: seq_mean_token_sum, seq_constant: 5}", 5)])
def test_seq_mean_token_sum_divides_by_the_budget_or_the_given_constant(tmp_path, monkeypatch, options, constant):
    """L = −(1/S) Σ_i Σ_t min(ρ A_i, clip(ρ) A_i) / L_const (arXiv 2503.20783 §3.4), L_const = rollout.max_new_tokens
    as TRL's dr_grpo and verl (responses padded to the budget) take it, written out from the learner's log-probs of a
    real round whose longest completion is shorter than the budget."""
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, SMALL + ["objective.name=grpo", f"objective.options={options}",
                                    f"rollout.max_new_tokens={BUDGET}", f"run_dir={tmp_path / 'run'}"])
    task, policy, pool, _ = prepare_run(cfg)
    parts = build_parts(cfg, task, policy, pool).parts
    try:
        batch = parts.source.next_batch(parts.learner.version)
        m = batch.packed.response_mask
        assert m.shape[1] < BUDGET, "every round's longest completion reached the budget: the test cannot tell"
        with torch.no_grad():
            ratio = (parts.learner.logprobs(batch).double() - batch.behavior_logprobs.double()).exp()
        adv = batch.advantages.double()[:, None]
        eps = 0.2
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        S = float((m.sum(1) > 0).sum())
        want = float((per_token * m).sum() / (S * constant))
        assert abs(want) > 1e-4  # informative groups
        got = parts.learner.train_on(batch)["loss"]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
    finally:
        parts.source.close()
        pool.close()
