"""The smallest config that runs the whole loop: shared by the end-to-end tests."""

# task.heldout_reserve=0: the base's SFT skips the 16 held-out prompts alone (the base the pinned metrics start from)
TINY = [
    "task.train_size=64", "task.heldout_size=16", "task.heldout_reserve=0", "model.hidden=32", "model.layers=1",
    "model.heads=2", "model.sft_steps=20", "model.sft_batch_size=16", "rollout.prompts_per_step=4",
    "rollout.group_size=4", "rollout.max_new_tokens=4", "train.micro_batch_size=8", "eval.every=2",
    "eval.samples_per_prompt=2", "checkpoint_every=2",
]
