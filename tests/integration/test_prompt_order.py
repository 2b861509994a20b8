"""Training prompts come in epochs (``rollout.prompt_order=epochs``, the default): every prompt once per epoch,
shuffled anew each epoch, as TRL's and verl's shuffled samplers give them. Drawn with replacement (the order before
this key, ``random``), about a third of a data set (1/e) went unseen in an epoch's worth of rounds.

Checked through the Python API's real run: a batch-form reward records the prompt of each group it scores, in order
(one call per group, in-process)."""

from trustbatch.api import Trainer

N, P, G = 6, 4, 2  # training rows, prompts per round, samples per prompt: 3 rounds are 2 epochs
ROWS = [{"prompt": f"Say the number {i}.", "answer": str(i)} for i in range(N + 4)]


def _prompts_per_group(tmp_path, shared_dir, *overrides) -> list[str]:
    calls: list[str] = []

    def record(prompts, completions, **columns):
        assert len(set(prompts)) == 1  # one group
        calls.append(prompts[0])
        return [0.0] * len(completions)

    Trainer(model=shared_dir / "models" / "stories260K-hf", reward_funcs=[record], train_dataset=ROWS[:N],
            eval_dataset=ROWS[N:], overrides=["reward.workers=0", f"rollout.prompts_per_step={P}",
                                              f"rollout.group_size={G}", "rollout.max_new_tokens=2", "train.steps=3",
                                              "eval.every=100", "eval.samples_per_prompt=1", "checkpoint_every=3",
                                              "threads=1", f"run_dir={tmp_path / 'run'}", *overrides]).train()
    return calls


def test_every_prompt_once_per_epoch_in_a_new_order_each_epoch(tmp_path, shared_dir):
    calls = _prompts_per_group(tmp_path, shared_dir)
    every = sorted(r["prompt"] for r in ROWS[:N])
    assert len(calls) == 3 * P == 2 * N
    first, second = calls[:N], calls[N:]
    assert sorted(first) == every and sorted(second) == every, calls
    assert first != second  # reshuffled (the same order twice: 1 in 720)


def test_random_order_draws_with_replacement(tmp_path, shared_dir):
    calls = _prompts_per_group(tmp_path, shared_dir, "rollout.prompt_order=random")
    assert len(calls) == 3 * P and set(calls) <= {r["prompt"] for r in ROWS[:N]}
    # 12 draws from 6 with replacement: some prompt twice within the first 6 (all distinct: 6!/6^6 = 1.5%)
    assert len(set(calls[:N])) < N, calls
