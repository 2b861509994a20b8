"""The gradients a learner's optimizer steps on, recorded before each step (shared by learner tests)."""

import contextlib
import copy

import torch


def _named_grads(model) -> dict:
    """A copy of each parameter's gradient, by name (parameters without one left out)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def sgd_recording_grads(learner, model, history: list | None = None) -> dict:
    """Swap in SGD and return a dict that each optimizer step fills with the gradients it used.

    history: when given, each step also appends (a copy of the model before the step, its gradients).

    SGD, not Adam: Adam's first step, lr·g/(|g| + eps), turns round-off in near-zero gradients into O(lr)
    differences between runs that compute the same gradient.
    """
    learner.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    grads: dict = {}

    def record(optimizer, args, kwargs):  # a step pre-hook: a replaced optimizer.step makes the scheduler warn
        grads.update(_named_grads(model))
        if history is not None:
            history.append((copy.deepcopy(model), dict(grads)))

    learner.optimizer.register_step_pre_hook(record)
    return grads


def step_gradients(learner, model, batch, context=None) -> tuple[dict, dict]:
    """``learner.step(batch)`` (inside ``context``) and the gradients its one optimizer step was given, by name.

    A step pre-hook, not a replaced ``optimizer.step``: the scheduler warns when ``step`` is swapped after it
    was built. With ``lr=0`` the real step then leaves the weights as they were (AdamW adds -0·update).
    Raises AssertionError unless exactly one optimizer step ran.
    Returns (gradients, the step's metrics).
    """
    steps: list[dict] = []
    hook = learner.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: steps.append(_named_grads(model)))
    try:
        with context or contextlib.nullcontext():
            metrics = learner.step(batch)
    finally:
        hook.remove()
    assert len(steps) == 1 and steps[0], f"expected one optimizer step with gradients, got {len(steps)}"
    return steps[0], metrics
