"""The lab's fixed rules (trustbatch.lab.stats) against hand-worked numbers and an independent t quantile."""

import math

import pytest

from trustbatch.lab.stats import collapse_reason, paired_interval, pick_tuned, primary_score, t_quantile


def _t_cdf(x: float, df: int, n: int = 200_000) -> float:
    """Student-t CDF by the midpoint rule on its density (independent of scipy)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    h = x / n
    return 0.5 + sum(c * (1 + ((i + 0.5) * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n)) * h


def test_t_quantile_matches_table_and_integral():
    assert t_quantile(0.975, 5) == pytest.approx(2.5706, abs=1e-4)  # printed t tables
    assert t_quantile(0.995, 5) == pytest.approx(4.0321, abs=1e-4)
    q = t_quantile(1 - 0.05 / 6, 5)  # Bonferroni over 3 comparisons
    assert _t_cdf(q, 5) == pytest.approx(1 - 0.05 / 6, abs=1e-7)


def test_primary_score_is_mean_of_last_two_after_round_zero():
    assert primary_score([(0, 0.9), (25, 0.1), (50, 0.2), (75, 0.3), (100, 0.5)]) == pytest.approx(0.4)
    assert primary_score([(100, 0.5), (0, 0.9), (75, 0.3)]) == pytest.approx(0.4)  # order does not matter
    with pytest.raises(ValueError, match="two held-out evaluations"):
        primary_score([(0, 0.2), (100, 0.3)])


@pytest.mark.parametrize("evals, rewards, expect", [
    # learned: no collapse
    ([(0, 0.20), (50, 0.25), (100, 0.30)], [0.2] * 50 + [0.3] * 50, None),
    # held-out at half of base or more: not collapsed by the first rule (0.10 vs 0.20 → exactly half)
    ([(0, 0.20), (50, 0.10), (100, 0.10)], [0.2] * 100, None),
    # held-out below half the base: collapsed
    ([(0, 0.20), (50, 0.09), (100, 0.09)], [0.2] * 100, "held-out"),
    # reward fell below half of its peak and stayed there: collapsed even though held-out looks fine
    ([(0, 0.20), (50, 0.20), (100, 0.20)], [0.4] * 50 + [0.1] * 50, "training reward"),
    # reward dipped below half of its peak but recovered by the end: not collapsed
    ([(0, 0.20), (50, 0.20), (100, 0.20)], [0.4] * 30 + [0.1] * 30 + [0.4] * 40, None),
])
def test_collapse_rule_table(evals, rewards, expect):
    reason = collapse_reason(evals, rewards)
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(expect)


def test_collapse_needs_the_base():
    with pytest.raises(ValueError, match="round-0"):
        collapse_reason([(50, 0.1), (100, 0.1)], [])


def test_paired_interval_by_hand():
    a = {0: 0.30, 1: 0.32, 2: 0.28, 3: 0.35, 4: 0.31, 5: 0.29}
    b = {0: 0.25, 1: 0.30, 2: 0.26, 3: 0.30, 4: 0.27, 5: 0.28, 9: 0.99}  # seed 9 has no partner: ignored
    d = [0.05, 0.02, 0.02, 0.05, 0.04, 0.01]
    m = sum(d) / 6  # 0.031667
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 5)
    half = 2.5706 * sd / math.sqrt(6)  # one comparison: t_{0.975, 5} from the table
    p = paired_interval("a", "b", a, b, comparisons=1)
    assert p.n == 6 and p.mean == pytest.approx(m)
    assert p.lo == pytest.approx(m - half, abs=1e-5) and p.hi == pytest.approx(m + half, abs=1e-5)
    assert p.verdict() == "a ahead"
    # the same data over 20 comparisons: wider, and no longer a call
    p20 = paired_interval("a", "b", a, b, comparisons=20)
    assert p20.hi - p20.lo > p.hi - p.lo


def test_verdicts_match_behind_cannot_tell():
    same = {s: 0.3 + 0.001 * s for s in range(6)}
    near = {s: v + (0.002 if s % 2 else -0.002) for s, v in same.items()}
    assert paired_interval("a", "b", same, near, 3).verdict() == "match"
    worse = {s: v - 0.05 + 0.002 * (s % 3) for s, v in same.items()}
    assert paired_interval("a", "b", worse, same, 3).verdict() == "b ahead"
    noisy = {s: v + (0.08 if s % 2 else -0.07) for s, v in same.items()}
    assert paired_interval("a", "b", noisy, same, 3).verdict() == "cannot tell"
    with pytest.raises(ValueError, match="two common seeds"):
        paired_interval("a", "b", {0: 0.1}, {0: 0.2}, 1)


def test_two_arms_collapsed_in_every_seed_are_not_a_match():
    floor = {s: 0.0 for s in range(3)}
    assert paired_interval("a", "b", floor, floor, 2).verdict() == "match"  # the interval alone: [0, 0]
    p = paired_interval("a", "b", floor, floor, 2, collapsed_both={0, 1, 2})
    assert p.verdict() == "both collapse" and "not a match" in p.sentence()
    # one seed where either arm survived: the interval decides again
    assert paired_interval("a", "b", floor, floor, 2, collapsed_both={0, 2}).verdict() == "match"


def test_tuned_baseline_is_picked_on_its_own_seeds_only():
    grid = ["eps0.2", "eps0.4", "eps0.6"]
    # on tuning seeds 6-8: eps0.4 mean 0.30, eps0.6 0.29, eps0.2 0.20; on seeds 0-1 eps0.6 would win by far
    scores = {"eps0.2": {6: 0.2, 7: 0.2, 8: 0.2, 0: 0.1, 1: 0.1},
              "eps0.4": {6: 0.25, 7: 0.35, 8: 0.30, 0: 0.1, 1: 0.1},
              "eps0.6": {6: 0.29, 7: 0.29, 8: 0.29, 0: 0.9, 1: 0.9}}
    pick, means = pick_tuned(grid, scores, [6, 7, 8])
    assert pick == "eps0.4" and means == pytest.approx({"eps0.2": 0.2, "eps0.4": 0.3, "eps0.6": 0.29})
    assert pick_tuned(grid, scores, [0, 1])[0] == "eps0.6"
    # a tie goes to the first listed, whatever the grid's order
    tie = {"a": {6: 0.3}, "b": {6: 0.3}}
    assert pick_tuned(["a", "b"], tie, [6])[0] == "a" and pick_tuned(["b", "a"], tie, [6])[0] == "b"
    with pytest.raises(ValueError, match="no primary score for eps0.6 seed 9"):
        pick_tuned(grid, {**scores, "eps0.2": {**scores["eps0.2"], 9: 0.5}, "eps0.4": {**scores["eps0.4"], 9: 0.5}},
                   [6, 9])
    with pytest.raises(ValueError, match="non-empty grid"):
        pick_tuned([], scores, [6])


def test_grpo_zeroed_share_by_hand():
    import torch

    from trustbatch.objectives.clipped import grpo_zeroed_shares

    # ratios 1.3, 0.7, 1.5, 0.5 | 1.1, 0.9, 1.0, (masked 0.1); advantages +, - per row
    r = torch.tensor([[1.3, 0.7, 1.5, 0.5], [1.1, 0.9, 1.0, 0.1]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    for adv, want in ((torch.tensor([1.0, -1.0]), {0.2: 2 / 7, 0.4: 1 / 7}),  # A>0: 1.3, 1.5 > 1.2; 1.5 > 1.4
                      (torch.tensor([-1.0, 1.0]), {0.2: 2 / 7, 0.4: 1 / 7})):  # A<0: 0.7, 0.5 < 0.8; 0.5 < 0.6
        got = grpo_zeroed_shares(r.log(), torch.zeros_like(r), adv, mask)
        assert got["grpo_zeroed_0.2"] == pytest.approx(want[0.2]) and got["grpo_zeroed_0.4"] == pytest.approx(want[0.4])
