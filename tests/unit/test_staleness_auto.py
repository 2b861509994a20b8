"""``rollout.max_staleness=auto``: each measured batch ESS moves the bound once (AIMD, ``pipeline.staleness``), also
across rounds that train on nothing and across a checkpoint and resume. Expected bounds are worked from the
controller's rule by hand: an ESS below 0.90 halves k, one in [0.90, 0.97) keeps it; none keeps it."""

import torch

from trustbatch.pipeline.async_source import BoundedSource
from trustbatch.trainer.loop import Parts, run_loop


class _Batch:
    def __init__(self, version):
        self.policy_version = torch.tensor([version])
        self.metrics = {}
        self.packed = type("P", (), {"response_mask": torch.ones(1, 1)})()

    def behaviour_versions(self):
        return self.policy_version


class _Transport:
    """Hands batch b at once when asked; the batches in ``empty`` are None (dynamic sampling kept no group)."""
    n, ahead = 1, None

    def __init__(self, empty=()):
        self.asked, self.empty, self.version = None, set(empty), 0

    def start(self, first):
        pass

    def request(self, b, k):
        self.asked = b

    def poll(self, timeout):
        b, self.asked = self.asked, None
        return None if b is None else ("batch", 0, b, (None if b in self.empty else _Batch(self.version), {}))

    def held(self, w):
        return -1

    def alive(self, w):
        return True

    def busy_since(self, w):
        return None

    def close(self):
        pass


def _source(transport, k):
    src = BoundedSource(transport, max_staleness="auto")
    src.controller.k = src.k = k
    return src


def test_a_round_that_trains_on_nothing_does_not_apply_the_last_ess_again():
    """Rounds 2 and 3 have no batch; before, round 1's one ESS of 0.5 halved k three times (8, 4, 2, 1, 1)."""
    ess = iter([0.5, 0.93, 0.93])

    class Learner:
        version, model, step_records = 0, None, []

        def train_on(self, batch):
            self.version += 1
            transport.version = self.version  # the next batches are sampled by the new policy: none is too stale
            return {"ess": next(ess)}

    class Hooks:
        bounds = []

        def before_train(self, r, batch):
            pass

        def after_round(self, r, metrics):
            self.bounds.append(int(metrics["max_staleness"]))

    transport = _Transport(empty={1, 2})
    hooks = Hooks()
    run_loop(Parts(_source(transport, 8), Learner(), type("Sync", (), {"push": lambda *a: None})()), hooks,
             start_round=0, rounds=5)
    assert hooks.bounds == [8, 4, 4, 4, 4]


def test_a_resume_applies_the_update_the_checkpointed_round_left_pending():
    """Every round's ESS is 0.5: k halves before each next batch, 16, 8, 4, 2. A checkpoint after round 2 lost the
    ESS it had measured, so the resumed run kept 8 for round 3 and stayed one halving behind."""
    def rounds(src, n):
        bounds = []
        for _ in range(n):
            src.next_batch(learner_version=0)
            bounds.append(src.k)
            src.on_update({"ess": 0.5})
        return bounds

    assert rounds(_source(_Transport(), 16), 4) == [16, 8, 4, 2]
    first = _source(_Transport(), 16)
    head = rounds(first, 2)
    resumed = _source(_Transport(), 16)
    resumed.load_state_dict(first.state_dict())
    assert head + rounds(resumed, 2) == [16, 8, 4, 2]
