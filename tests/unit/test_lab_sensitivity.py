"""Issue 47 item 1: the analyses registered for confirm_t12 beside the paired interval: the Wilcoxon signed-rank
sensitivity test, the objective × temperature interaction, the registered TOST margin and the planning power.
Each is checked against an independent computation: sign-flip enumeration, a hand formula, Monte Carlo."""

import itertools
import math

import numpy as np
import pytest
import yaml

from trustbatch.errors import UserError
from trustbatch.lab.experiment import load_experiment
from trustbatch.lab.report import write_report
from trustbatch.lab.stats import interaction, power_paired, signed_rank, t_quantile

from lab_runs import write_runs


def _exact_signed_rank_p(d: list[float]) -> float:
    """Two-sided exact p by enumerating all 2^n sign assignments of the ranks |d| (no ties, no zeros)."""
    ranks = {v: i + 1 for i, v in enumerate(sorted(abs(x) for x in d))}
    w_plus = sum(ranks[abs(x)] for x in d if x > 0)
    total = len(d) * (len(d) + 1) / 2
    observed = min(w_plus, total - w_plus)
    count = 0
    for signs in itertools.product((0, 1), repeat=len(d)):
        w = sum(r for r, s in zip(range(1, len(d) + 1), signs) if s)
        count += min(w, total - w) <= observed
    return count / 2 ** len(d)


def test_signed_rank_is_the_exact_test_by_enumeration():
    a = {s: 0.5 for s in range(10)}
    d = [0.031, -0.012, 0.054, 0.008, -0.027, 0.066, 0.019, 0.043, -0.004, 0.072]
    b = {s: 0.5 - x for s, x in enumerate(d)}
    res = signed_rank("a", "b", a, b)
    assert res.n == 10 and res.positive == 7
    assert res.p == pytest.approx(_exact_signed_rank_p(d), abs=1e-12)
    # every seed favours a: the most extreme outcome, p = 2 / 2^n
    all_up = signed_rank("a", "b", {s: 1.0 + s / 100 for s in range(6)}, {s: 0.0 for s in range(6)})
    assert all_up.p == pytest.approx(2 / 64) and all_up.statistic == 0


def test_signed_rank_with_ties_says_it_is_the_normal_approximation():
    """Tied |d|: no exact null distribution; the sentence said "exact" whatever scipy computed. The p-value is the
    normal approximation with the tie correction, worked here by hand (Wilcoxon 1945; the midrank variance)."""
    d = [0.02, 0.02, -0.01, 0.05, 0.03, 0.03, 0.04, -0.06]
    res = signed_rank("a", "b", dict(enumerate(d)), {s: 0.0 for s in range(len(d))})
    mags = sorted(abs(x) for x in d)
    midrank = {v: (mags.index(v) + 1 + len(mags) - mags[::-1].index(v)) / 2 for v in mags}
    w_plus = sum(midrank[abs(x)] for x in d if x > 0)
    n = len(d)
    ties = sum(t ** 3 - t for t in (mags.count(v) for v in set(mags)))
    z = (min(w_plus, n * (n + 1) / 2 - w_plus) - n * (n + 1) / 4) / math.sqrt(n * (n + 1) * (2 * n + 1) / 24 - ties / 48)
    assert res.p == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), abs=1e-12)
    assert not res.exact and "(sensitivity, normal approximation, two-sided)" in res.sentence()
    assert "(sensitivity, exact, two-sided)" in signed_rank("a", "b", {0: 0.3, 1: 0.1, 2: 0.2}, {0: 0, 1: 0, 2: 0}).sentence()


def test_signed_rank_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError, match="two common seeds"):
        signed_rank("a", "b", {0: 1.0}, {0: 0.5})
    with pytest.raises(ValueError, match="nothing to rank"):
        signed_rank("a", "b", {0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})


def test_interaction_is_the_difference_of_differences_by_hand():
    scores = {"p@1.2": {0: 0.60, 1: 0.70, 2: 0.65}, "g@1.2": {0: 0.50, 1: 0.55, 2: 0.60},
              "p@1.0": {0: 0.58, 1: 0.66, 2: 0.61}, "g@1.0": {0: 0.57, 1: 0.62, 2: 0.62, 9: 0.1}}
    res = interaction((("p@1.2", "g@1.2"), ("p@1.0", "g@1.0")), scores)
    dd = [(0.60 - 0.50) - (0.58 - 0.57), (0.70 - 0.55) - (0.66 - 0.62), (0.65 - 0.60) - (0.61 - 0.62)]
    mean = sum(dd) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in dd) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t_{0.975, 2} from the table
    assert res.n == 3  # seed 9 is missing from three arms
    assert (res.mean, res.lo, res.hi) == pytest.approx((mean, mean - half, mean + half), abs=1e-9)
    assert res.edges == pytest.approx(((0.10 + 0.15 + 0.05) / 3, (0.01 + 0.04 - 0.01) / 3), abs=1e-12)
    assert res.lo > 0 and "larger in the first" in res.sentence()
    with pytest.raises(ValueError, match="needs scores for"):
        interaction((("p@1.2", "x"), ("p@1.0", "g@1.0")), scores)


def test_power_matches_a_monte_carlo_of_the_paired_t_test():
    rng = np.random.default_rng(0)
    n, delta, sd, draws = 16, 0.056, 0.067, 200_000
    d = rng.normal(delta, sd, size=(draws, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    simulated = float(np.mean(np.abs(t) > t_quantile(0.975, n - 1)))
    assert power_paired(delta, sd, n) == pytest.approx(simulated, abs=0.004)
    assert power_paired(0.0, sd, n) == pytest.approx(0.05, abs=1e-9)  # at no effect the power is the level


def test_the_registered_analysis_keys_are_checked(tmp_path):
    arms = {"p@1.2": {"objective.name": "p3o"}, "g@1.2": {"objective.name": "grpo"}}
    for bad, why in (({"equivalence_margin": -0.05}, "equivalence_margin"), ({"wilcoxon": "yes"}, "wilcoxon"),
                     ({"interaction": [["p@1.2", "g@1.2"], ["p@1.2", "nope"]]}, "interaction")):
        path = tmp_path / "e.yaml"
        path.write_text(yaml.safe_dump({"arms": arms, **bad}))
        with pytest.raises(UserError, match=why):
            load_experiment(str(path))


def test_the_bundled_confirm_t12_registers_its_analysis():
    exp = load_experiment("confirm_t12")
    assert len(exp.seeds) == 16 and not set(exp.seeds) & set(range(10, 18)) and not set(exp.seeds) & set(range(6))
    assert exp.compare == [("p3o@T1.2", "grpo_eps0.4@T1.2")]
    assert {exp.arms[a]["rollout.temperature"] for a in exp.arms} == {1.2, 1.0}


def test_the_report_gives_the_wilcoxon_interaction_and_the_registered_margin(tmp_path):
    exp = tmp_path / "runs" / "e"
    finals = {"p@1.2": [0.60, 0.62, 0.66, 0.59], "g@1.2": [0.50, 0.55, 0.58, 0.57],
              "p@1.0": [0.58, 0.60, 0.61, 0.57], "g@1.0": [0.57, 0.58, 0.61, 0.55]}
    write_runs(exp, finals)
    spec = {"arms": {a: {} for a in finals}, "compare": [["p@1.2", "g@1.2"]], "equivalence_margin": 0.05,
            "wilcoxon": True, "interaction": [["p@1.2", "g@1.2"], ["p@1.0", "g@1.0"]]}
    (exp / "experiment.yaml").write_text(yaml.safe_dump(spec))
    text = write_report(tmp_path / "runs", tmp_path / "r", figures="none").read_text()
    d = [a - b for a, b in zip(finals["p@1.2"], finals["g@1.2"])]
    assert f"p = {_exact_signed_rank_p(d):.3g}; 4 of 4 seeds favour p@1.2." in text
    dd = [x - (a - b) for x, a, b in zip(d, finals["p@1.0"], finals["g@1.0"])]
    assert f"(p@1.2 − g@1.2) − (p@1.0 − g@1.0) = {sum(dd) / 4:+.3f}" in text
    assert "'Equivalent within ±0.05' is tested" in text


def _two_arm_report(tmp_path, gaps: list[float]) -> str:
    exp = tmp_path / "runs" / "e"
    write_runs(exp, {"p": [0.6 + g for g in gaps], "g": [0.6] * len(gaps)})
    (exp / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p": {}, "g": {}}, "compare": [["p", "g"]], "wilcoxon": True}))
    text = write_report(tmp_path / "runs", tmp_path / "r", figures="none").read_text()
    return text, next(x for x in text.splitlines() if "Wilcoxon signed-rank (sensitivity" in x)


def test_the_report_says_when_the_signed_rank_test_and_the_interval_disagree(tmp_path):
    # five steady gains: the t-interval excludes 0, but five signs cannot reach p < 0.05 (exact p = 2/32)
    gaps = [0.050, 0.051, 0.052, 0.053, 0.054]
    text, line = _two_arm_report(tmp_path / "a", gaps)
    assert _exact_signed_rank_p(gaps) == pytest.approx(2 / 32)
    assert "**p ahead**" in text and "disagree at α = 0.05; the registered verdict is the interval's." in line
    # eight steady gains: both reject, no disagreement is reported
    text, line = _two_arm_report(tmp_path / "b", [0.01 + i / 1000 for i in range(8)])
    assert "**p ahead**" in text and "disagree" not in line


def test_the_rules_table_lists_the_opt_in_rule_only_for_the_experiments_that_ask_for_it(tmp_path):
    text, _ = _two_arm_report(tmp_path, [0.05, 0.051, 0.052])
    assert "| Wilcoxon sensitivity and interaction | `" in text  # e asks for wilcoxon
    spec_path = tmp_path / "runs" / "e" / "experiment.yaml"
    spec_path.write_text(yaml.safe_dump({"arms": {"p": {}, "g": {}}, "compare": [["p", "g"]]}))
    text = write_report(tmp_path / "runs", tmp_path / "r2", figures="none").read_text()
    assert "Wilcoxon sensitivity and interaction" not in text and "| equivalence (TOST) | `" in text
