"""Issue 45 item 4: the learning-rate schedules equal transformers' own after the warm-up, and the warm-up is
(s + 1) / warmup by hand."""

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from trustbatch.trainer.schedule import lr_multiplier


def _lrs(make, steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind, theirs", [("linear", get_linear_schedule_with_warmup),
                                          ("cosine", get_cosine_schedule_with_warmup)])
def test_the_decays_are_transformers_after_the_warmup(kind, theirs):
    warm, total = 5, 40
    ours = _lrs(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_multiplier(kind, warm, total)), total + 3)
    ref = _lrs(lambda o: theirs(o, warm, total), total + 3)
    assert ours[warm:total + 1] == pytest.approx(ref[warm:total + 1], abs=1e-12)
    assert ours[total:] == [0.0] * 3  # past the last step: 0 (transformers' cosine would rise again)
    assert ours[:warm] == pytest.approx([(s + 1) / warm for s in range(warm)], abs=1e-15)


def test_constant_is_the_old_warmup_then_one_and_bad_kinds_are_refused():
    assert [lr_multiplier("constant", 4, 10)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_multiplier("cosine", 0, 10)(0) == 1.0
    with pytest.raises(ValueError, match="lr schedule"):
        lr_multiplier("step", 1, 10)
