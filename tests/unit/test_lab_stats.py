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


def test_both_collapse_says_what_the_earlier_rules_read():
    from trustbatch.lab.stats import SCORE_RULES, Paired

    # temperature at T = 1.5 (the archive's numbers): interval wholly below 0, every seed collapsed in both arms
    p = Paired("p3o", "grpo", 6, -0.043, -0.048, -0.037, 1 - 0.05 / 4, both_collapsed=True)
    assert p.verdict() == "both collapse" and p.verdict_fixed_before_runs() == "grpo ahead"
    note = p.earlier_rules_note()
    assert note == f"by the rules of `{SCORE_RULES}` alone it reads 'grpo ahead'"
    at_floor = Paired("p3o", "grpo", 6, -0.0, -0.0001, 0.0001, 1 - 0.05 / 4, both_collapsed=True)
    assert at_floor.verdict_fixed_before_runs() == "match"  # what the post-hoc rule was written to prevent
    assert Paired("p3o", "grpo", 6, -0.043, -0.048, -0.037, 1 - 0.05 / 4).earlier_rules_note() is None


def test_tost_by_hand_and_against_scipy_one_sided_t_tests():
    from scipy.stats import ttest_1samp

    from trustbatch.lab.stats import tost

    d = [0.010, -0.004, 0.002, 0.006, -0.002, 0.000]
    a, b = {s: 0.5 + x for s, x in enumerate(d)}, {s: 0.5 for s in range(6)}
    # by hand: mean 0.002, squared deviations sum 136e-6, sd = sqrt(27.2e-6), se = sd / sqrt(6)
    sd, se = math.sqrt(27.2e-6), math.sqrt(27.2e-6 / 6)
    e = tost("a", "b", a, b, comparisons=1, margin=0.02)
    assert e.mean == pytest.approx(0.002, abs=1e-12) and e.sd == pytest.approx(sd, rel=1e-9)
    # t-table values: t_{0.95,5} = 2.0150, t_{0.90,5} = 1.4759 (80% power at a true difference of 0)
    assert e.resolvable == pytest.approx((2.0150 + 1.4759) * se, rel=1e-4)  # 0.00743
    lower = ttest_1samp(d, -0.02, alternative="greater").pvalue  # H0: mean <= -0.02
    upper = ttest_1samp(d, 0.02, alternative="less").pvalue  # H0: mean >= +0.02
    assert e.p == pytest.approx(max(lower, upper), rel=1e-9) and e.verdict() == "equivalent"
    assert "**equivalent within ±0.02**" in e.sentence()
    # a tighter margin than the design resolves is not tested, whatever the p-value would be
    tight = tost("a", "b", a, b, comparisons=1, margin=0.005)
    assert tight.verdict() == "beyond the design" and "no equivalence is tested" in tight.sentence()
    # shifted differences inside a resolvable margin but too close to its edge: not shown
    far = tost("a", "b", {s: v + 0.015 for s, v in a.items()}, b, comparisons=1, margin=0.02)
    assert far.p == pytest.approx(ttest_1samp([x + 0.015 for x in d], 0.02, alternative="less").pvalue, rel=1e-9)
    assert far.p > 0.05 and far.verdict() == "not shown equivalent"


def test_resolvable_margin_grows_with_the_correction_and_shrinks_with_seeds():
    from trustbatch.lab.stats import resolvable_margin

    # Bonferroni over 4 at n = 6: t_{1-0.0125,5} = 3.1634 (t table, two-sided 0.025), t_{0.90,5} = 1.4759
    assert resolvable_margin(0.03, 6, 4) == pytest.approx((3.1634 + 1.4759) * 0.03 / math.sqrt(6), rel=1e-4)
    q = t_quantile(1 - 0.05 / 4, 5)
    assert _t_cdf(q, 5) == pytest.approx(1 - 0.05 / 4, abs=1e-7)  # the quantile against an independent integral
    assert resolvable_margin(0.03, 6, 1) < resolvable_margin(0.03, 6, 4)
    assert resolvable_margin(0.03, 12, 4) < resolvable_margin(0.03, 6, 4)
    with pytest.raises(ValueError, match="n >= 2"):
        resolvable_margin(0.03, 1, 1)


def test_tost_with_equal_differences_everywhere():
    from trustbatch.lab.stats import tost

    same = {0: 0.3, 1: 0.4, 2: 0.5}
    e = tost("a", "b", same, same, comparisons=2)
    assert e.sd == 0 and e.resolvable == 0 and e.p == 0 and e.verdict() == "equivalent"
    off = tost("a", "b", {s: v + 0.05 for s, v in same.items()}, same, comparisons=2)
    assert off.p == 1 and off.verdict() == "not shown equivalent"


def test_report_says_a_match_at_an_unresolved_margin_is_no_difference_found():
    from trustbatch.lab.report.tables import equivalence_lines
    from trustbatch.lab.stats import Equivalence

    wide = Equivalence("a", "b", 6, 0.001, 0.012, 0.02, 0.025, 0.001, 0.0125)  # resolvable ±0.025 > ±0.02
    narrow = Equivalence("a", "c", 6, 0.001, 0.005, 0.02, 0.010, 0.001, 0.0125)
    lines = equivalence_lines([(wide, True), (narrow, True)], "21f970c", "post hoc")
    assert "±0.010 to ±0.025" in lines[0]
    assert lines[2].endswith("read it as 'no difference found', not as equivalence.") and "beyond it" in lines[2]
    assert lines[3].endswith("**equivalent within ±0.02**.")
    assert equivalence_lines([], "21f970c", "post hoc") == []


def test_the_match_caveat_follows_the_interval_rules_margin_not_the_tost_margin():
    """The interval rule reads 'match' at ±0.02 (``MARGIN``) whatever ``equivalence_margin`` is, so whether that
    'match' rests on a resolved margin is ±0.02 against the pair's resolvable margin: at a TOST margin of 0.05 a
    pair resolving ±0.025 still needs the caveat, and at 0.01 a pair resolving ±0.0125 does not."""
    from trustbatch.lab.report.tables import equivalence_lines
    from trustbatch.lab.stats import MARGIN, Equivalence

    caveat = "read it as 'no difference found', not as equivalence."
    wide = Equivalence("a", "b", 8, 0.0, 0.0214, 0.05, 0.025, 1.5e-4, 0.05)
    lines = equivalence_lines([(wide, True)], "21f970c", "fixed before these runs", margin=0.05)
    assert MARGIN < wide.resolvable and lines[2].endswith(caveat), lines[2]
    narrow = Equivalence("a", "b", 8, 0.0, 0.0107, 0.01, 0.0125, 0.2, 0.05)
    lines = equivalence_lines([(narrow, True)], "21f970c", "fixed before these runs", margin=0.01)
    assert MARGIN >= narrow.resolvable and "beyond it" in lines[2] and not lines[2].endswith(caveat), lines[2]
