"""What TRL's GRPOTrainer passes every reward function beside the batch (``rewards.trl_kwargs``): ``trainer_state``
(where training stands), ``log_metric`` and ``log_extra``, in this process and in reward workers. Reference: the
state worked by hand from the run's settings, the logged values from the completions the function saw."""

import json

import pytest

from trustbatch.api import Trainer

from runproc import records
from scorers_for_tests import trl_state_and_logs

ROWS = [{"prompt": f"Once upon a time, a cat named Tom {i} "} for i in range(40)]
P, G = 4, 4
RUN = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=2",
       "train.minibatches=2", "eval.every=2", "eval.samples_per_prompt=2", "data.heldout_size=8", "threads=1",
       "log.samples.every=1", "log.samples.train=3", "log.samples.heldout=2"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_gets_trls_trainer_state_and_its_logs_are_recorded(tmp_path, shared_dir, monkeypatch, workers):
    calls_file = tmp_path / "calls.jsonl"
    monkeypatch.setenv("SCORER_CALLS", str(calls_file))
    run = tmp_path / "run"
    Trainer(model=shared_dir / "models" / "stories260K-hf", reward_funcs=[trl_state_and_logs], train_dataset=ROWS[8:],
            eval_dataset=ROWS[:8], overrides=RUN + [f"run_dir={run}", f"reward.workers={workers}"]).train()
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    # held-out evaluation at round 0 (8 prompts × 2 samples, then greedy), rounds 1 and 2 (P groups of G), held-out
    # evaluation at round 2; reward workers answer a call's groups in any order, so compared as sets of states
    phases = [(8, 2), (8, 1), (P, G), (P, G), (8, 2), (8, 1)]
    assert [len(c[3]) for c in calls] == [n for k, n in phases for _ in range(k)]
    steps, per_round = 2 * 1 * 2, 2  # train.steps × train.epochs × train.minibatches; optimizer steps per round
    # (global_step, max_steps, epoch): the policy's optimizer steps, the run's, the passes over the 32 training
    # prompts drawn before (P per round)
    state = [(0, steps, 0.0), (0, steps, 0.0), (0, steps, 0.0), (per_round, steps, P / 32),
             (2 * per_round, steps, 2 * P / 32), (2 * per_round, steps, 2 * P / 32)]
    bounds = [0]
    for k, _ in phases:
        bounds.append(bounds[-1] + k)
    for (a, b), want in zip(zip(bounds, bounds[1:]), state):
        assert {tuple(c[:3]) for c in calls[a:b]} == {want}
    recs = records(run)

    def mean_len(cs):  # the metric: each call's mean length, averaged over the calls
        return sum(sum(len(c) for c in g) / len(g) for g in cs) / len(cs)

    assert recs[0]["heldout_reward_metrics/mean_len"] == pytest.approx(mean_len([c[3] for c in calls[0:8]]), abs=1e-12)
    for k in (1, 2):
        a = bounds[k + 1]
        got = recs[k]["reward_metrics/mean_len"]
        assert got == pytest.approx(mean_len([c[3] for c in calls[a:a + P]]), abs=1e-12)
    assert recs[2]["heldout_reward_metrics/mean_len"] == pytest.approx(
        mean_len([c[3] for c in calls[bounds[4]:bounds[5]]]), abs=1e-12)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({(s["round"], s["split"]) for s in samples}) == [(0, "heldout"), (1, "train"), (2, "heldout"),
                                                                   (2, "train")]
    # the column each sample's own call logged for it, after the row's own keys
    assert all(s["length"] == len(s["completion"]) and list(s)[-1] == "length" for s in samples)
    assert all(s["reward"] == len(s["completion"]) % 3 / 2 for s in samples)
