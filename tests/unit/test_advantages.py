import itertools
import math

import pytest
import torch

from trustbatch.advantages import group_advantages, informative_groups, overlong_penalty
from trustbatch.eval import pass_at_k


def test_document_examples():
    r = torch.tensor([1.0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    pop = group_advantages(r, g, "zscore", std="population", eps=0.0 + 1e-12)
    assert pop[:4].tolist() == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], rel=1e-6)
    assert pop[4:].tolist() == [0, 0, 0, 0]  # all-equal group: zero advantage
    sample = group_advantages(r, g, "zscore", std="sample", eps=1e-12)
    assert sample[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-6)
    assert group_advantages(r, g, "mean")[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert group_advantages(r, g, "rloo")[:4].tolist() == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3], rel=1e-6)


def test_rloo_is_leave_one_out_by_brute_force():
    torch.manual_seed(0)
    r = torch.rand(10)
    g = torch.tensor([0] * 4 + [1] * 6)
    a = group_advantages(r, g, "rloo")
    for i in range(10):
        others = [r[j].item() for j in range(10) if g[j] == g[i] and j != i]
        assert a[i].item() == pytest.approx(r[i].item() - sum(others) / len(others), rel=1e-5)


def test_groups_need_not_be_contiguous_and_bad_input():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    g = torch.tensor([7, 3, 7, 3])
    a = group_advantages(r, g, "mean")
    assert a.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(r, g, "gae")
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([float("nan"), 0, 0, 0]), g)


def test_dynamic_sampling_filter_and_overlong_penalty():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    assert informative_groups(r, g).tolist() == [False, False, True, True, False, False]
    pen = overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), max_len=20, cache_len=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hit = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12)
    assert pass_at_k(16, 2, 1) == pytest.approx(0.125)
    assert pass_at_k(16, 2, 4) == pytest.approx(0.45)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_rows_no_reward_applies_to_are_out_of_their_groups_statistics_and_get_0():
    """``valid``: TRL 1.16's mask of NaN rewards. By hand: rewards (3, 2, ·, ·) of one group with the last two
    unscored: mean 2.5; population σ 0.5, sample σ √0.5; rloo over the two scored rows."""
    import math

    r, g = torch.tensor([3.0, 2.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    valid = torch.tensor([True, True, False, False])
    expect = {"mean": [0.5, -0.5, 0, 0], "rloo": [1, -1, 0, 0]}
    for est, want in expect.items():
        assert group_advantages(r, g, est, valid=valid).tolist() == pytest.approx(want, abs=1e-6)
    assert group_advantages(r, g, "zscore", valid=valid, eps=1e-12).tolist() == pytest.approx([1, -1, 0, 0], abs=1e-6)
    s = 0.5 / math.sqrt(0.5)
    assert group_advantages(r, g, "zscore", std="sample", valid=valid, eps=1e-12).tolist() == pytest.approx(
        [s, -s, 0, 0], abs=1e-6)
    # a group with no scored row: all 0, nothing divided by 0
    assert group_advantages(r, g, "zscore", valid=torch.zeros(4, dtype=torch.bool)).tolist() == [0.0] * 4
