"""A learner whose optimizer is plain SGD and that records the gradients it steps on (shared by learner tests)."""

import copy

import torch


def sgd_recording_grads(learner, model, history: list | None = None) -> dict:
    """Swap in SGD and return a dict that each optimizer step fills with the gradients it used.

    history: when given, each step also appends (a copy of the model before the step, its gradients).

    SGD, not Adam: Adam's first step, lr·g/(|g| + eps), turns round-off in near-zero gradients into O(lr)
    differences between runs that compute the same gradient.
    """
    learner.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    grads: dict = {}
    real_step = learner.optimizer.step

    def record_then_step(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        if history is not None:
            history.append((copy.deepcopy(model), dict(grads)))
        return real_step(*a, **k)

    learner.optimizer.step = record_then_step
    return grads
