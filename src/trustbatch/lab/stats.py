"""The lab's statistics: primary score, collapse rule, paired intervals, verdicts, tuned baseline.

Each rule names the commit that introduced it (``RULES``). A rule is **fixed before the runs** it judges exactly
when its commit is an ancestor of (or is) the recorded commit of every one of those runs: each ``lab run`` call's
commit in the experiment's ``calls.jsonl`` (or ``experiment.yaml``'s ``commit`` for an experiment without one). It
is **post hoc** when some run's commit does not descend from it, and **not known to precede the runs** when a run's
commit was not recorded (a call kept only as its summed time) or git cannot tell. The report computes each label
from git ancestry (``report.provenance.rule_standing``), never from a key a person writes.

- **Primary score** of a run (``65a2513``, before every Lab II run): the mean held-out pass@1 of its last two
  evaluations (a single final evaluation on 256 prompts × 8 samples still has a standard deviation of about 0.008).
- **Collapse** of a run (``65a2513``, before every Lab II run): its primary score falls below half of its own base
  (the round-0 evaluation of the same seed's base), or its training reward (10-round moving mean) falls below
  half of its peak and is still below at the last round. The first catches a policy that lost the task; the
  second, one whose reward fell apart late and did not recover before the held-out points caught it.
- **Paired intervals** (``65a2513``, before every Lab II run): arms share seeds (same base, same prompts, same
  evaluation stream), so arms are compared through the per-seed differences d_s = score_A(s) − score_B(s); the
  interval is mean(d) ± t_{1 − α/(2m), n−1} · sd(d)/√n, a paired t-interval with a Bonferroni correction over the
  m comparisons of one experiment (α = 0.05).
- **Verdicts** (``65a2513``, before every Lab II run): A ahead when the whole interval is above 0, behind when
  below; "matches" only when the whole interval lies inside ±``margin`` (0.02 by default); otherwise the test
  could not tell.
- **Both collapse** (``8e394b5``): two arms that both collapse in every common seed read "both
  collapse", never "match": scores at the floor agree without saying anything about the objectives. It was
  written after the first Lab II run in which every arm collapsed (``temperature_steps`` at T = 1.5, on the
  evening of 2026-11-22), so it was chosen knowing that run's outcome: post hoc for those runs, which no archive
  holds. Every archived Lab II run was made at a commit that descends from it (the archived ``temperature`` and
  ``temperature_steps`` runs are replicates on rebuilt bases, trained from 2026-11-24 on), so by ancestry it is
  fixed before them; ``precision_steps``' first calls recorded no commit, so there it is not known to precede the
  runs. On the archives it decides four verdicts, all at T = 1.5: on ``temperature``, P3O − GRPO ε = 0.2 would
  otherwise read "grpo_eps0.2@T1.5 ahead" (−0.043 [−0.048, −0.037]) and P3O − GRPO ε = 0.4 "cannot tell"; on
  ``temperature_steps``, both comparisons "match". ``Paired.verdict_fixed_before_runs`` gives the verdict without
  it, and the report prints that beside each "both collapse", whatever the rule's label.
- **Equivalence** (``21f970c``, issue 38; post hoc for every archived Lab II experiment, written after all of
  them had been seen; fixed before the runs of Lab III, ``confirm_fp8`` and ``temperature_t12_steps``): the two
  one-sided tests
  (TOST, Schuirmann 1987) at the experiment's Bonferroni level α/m. The design's **resolvable margin** is the
  smallest δ at which TOST has ``POWER`` (80 %) to show equivalence when the true difference is 0:
  δ_min = (t_{1 − α/m, n−1} + t_{1 − (1 − POWER)/2, n−1}) · sd(d)/√n, the usual sample-size relation for
  equivalence at a zero true difference (Chow, Shao & Wang, *Sample Size Calculations in Clinical Research*,
  one-sample design).
  "Equivalent within δ" is claimed only when δ ≥ δ_min and both one-sided p-values are below α/m; where δ < δ_min
  the report says the margin is beyond the design instead of testing it. It decides no earlier verdict: "match"
  stays the interval rule above, and a match implies TOST equivalence at the same δ.
- **Tuned baseline** (``35c598b``, before ``clip``'s runs at ``01de356``, the one experiment that uses it; where
  the claim is "matches tuned baselines"): among a grid of arms, the one with the highest mean primary score over
  tuning seeds that the comparison never uses (the first listed on a tie). It is then compared on the
  experiment's own seeds like any other arm, inside the same Bonferroni family.

- **Sensitivity and interaction** (``SENSITIVITY_RULE``, issue 47, registered with ``confirm_t12`` before its
  runs): an experiment that asks for it (``wilcoxon: true``) gets, beside each paired interval, the exact two-sided
  Wilcoxon signed-rank test of the same per-seed differences (``scipy.stats.wilcoxon``; Wilcoxon 1945), which needs
  no normality and is not moved by one seed's extreme difference. It decides no verdict: it is reported beside the
  interval. An experiment that names an ``interaction`` ([[A1, B1], [A2, B2]]) gets the difference of differences
  dd_s = (A1(s) − B1(s)) − (A2(s) − B2(s)) over the seeds all four arms share, with its paired t-interval at 95 %
  (one secondary question, outside the primary family): whether A's edge over B under one condition differs from
  its edge under the other. ``equivalence_margin`` sets the experiment's TOST margin (0.02 when absent).
- **Power** (``power_paired``): the planning power of the two-sided paired t-test at a true effect δ, from the
  noncentral t distribution with noncentrality δ/(sd/√n) (``scipy.stats.nct``); the registrations' power tables.

Formulas: the textbook paired t-interval and Bonferroni correction.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

ALPHA = 0.05
MARGIN = 0.02
# the commits that introduced each rule (module docstring); the report labels each by ancestry against the runs
SCORE_RULES = "65a2513"  # primary score, collapse, paired intervals, verdicts
BOTH_COLLAPSE_RULE = "8e394b5"
EQUIVALENCE_RULE = "21f970c"  # TOST and the resolvable margin
TUNED_RULE = "35c598b"
# the Wilcoxon sensitivity analysis and the interaction: the commit that added them, before confirm_t12's runs
SENSITIVITY_RULE = "1f80936"
RULES = {"primary score, collapse, paired intervals and verdicts": SCORE_RULES, "both collapse": BOTH_COLLAPSE_RULE,
         "equivalence (TOST)": EQUIVALENCE_RULE, "tuned baseline": TUNED_RULE,
         "Wilcoxon sensitivity and interaction": SENSITIVITY_RULE}
# rules that judge only the experiments that ask for them (``wilcoxon``, ``interaction`` in their YAML)
OPT_IN_RULES = {"Wilcoxon sensitivity and interaction"}
POWER = 0.8
COLLAPSE_FRACTION = 0.5
REWARD_WINDOW = 10


def primary_score(evals: list[tuple[int, float]]) -> float:
    """Mean of the last two held-out evaluations after round 0.

    Args:
        evals: (round, held-out pass@1) pairs, any order; round 0 is the base and is not counted.

    Raises:
        ValueError: fewer than two evaluations after round 0 (the run is unfinished or eval.every too coarse).
    """
    after = [v for s, v in sorted(evals) if s > 0]
    if len(after) < 2:
        raise ValueError(f"a primary score needs two held-out evaluations after round 0, got {len(after)}; "
                         "finish the run or set eval.every to at most half of train.steps")
    return (after[-1] + after[-2]) / 2


def moving_mean(xs: list[float], window: int = REWARD_WINDOW) -> list[float]:
    """Trailing mean over ``window`` values (shorter at the start)."""
    return [sum(xs[max(0, i - window + 1):i + 1]) / len(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]


def collapse_reason(evals: list[tuple[int, float]], rewards: list[float]) -> str | None:
    """Why a run collapsed by the lab's rule (see the module docstring), or None if it did not.

    Args:
        evals: (round, held-out pass@1), including round 0 (the base).
        rewards: the training reward per round, in order.

    Raises:
        ValueError: no round-0 evaluation, or too few evaluations for a primary score.
    """
    base = [v for s, v in evals if s == 0]
    if not base:
        raise ValueError("the collapse rule needs the round-0 (base) evaluation of the run")
    score = primary_score(evals)
    if score < COLLAPSE_FRACTION * base[0]:
        return f"held-out {score:.3f} < half of base {base[0]:.3f}"
    if rewards:
        smooth = moving_mean(rewards)
        peak = max(smooth)
        if peak > 0 and smooth[-1] < COLLAPSE_FRACTION * peak:
            return f"training reward {smooth[-1]:.3f} < half of its peak {peak:.3f} at the end"
    return None


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (scipy.stats.t.ppf)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


@dataclass
class Paired:
    """A paired comparison of arm ``a`` against arm ``b`` over their common seeds."""

    a: str
    b: str
    n: int
    mean: float  # mean of score_a − score_b
    lo: float
    hi: float
    level: float  # this interval's own level, 1 − α/m, so the m intervals hold together at 1 − α
    both_collapsed: bool = False  # both arms collapsed in every one of the n seeds

    def verdict(self, margin: float = MARGIN) -> str:
        """'a ahead' | 'b ahead' | 'match' | 'cannot tell' | 'both collapse' (module docstring)."""
        if self.both_collapsed:
            return "both collapse"
        return self.verdict_fixed_before_runs(margin)

    def verdict_fixed_before_runs(self, margin: float = MARGIN) -> str:
        """The verdict by the rules of ``SCORE_RULES`` alone, without "both collapse" (``BOTH_COLLAPSE_RULE``)."""
        if self.lo > 0:
            return f"{self.a} ahead"
        if self.hi < 0:
            return f"{self.b} ahead"
        if -margin <= self.lo and self.hi <= margin:
            return "match"
        return "cannot tell"

    def sentence(self, margin: float = MARGIN) -> str:
        v = self.verdict(margin)
        text = {"match": f"match within ±{margin}", "cannot tell": "the test cannot tell",
                "both collapse": f"**both collapse** in all {self.n} seeds (a tie at the floor, not a match)"
                }.get(v, f"**{v}**")
        return (f"{self.a} − {self.b} = {self.mean:+.3f}, paired {100 * self.level:.2f}% interval "
                f"[{self.lo:+.3f}, {self.hi:+.3f}] over {self.n} seeds: {text}.")

    def earlier_rules_note(self, margin: float = MARGIN) -> str | None:
        """What the rules of ``SCORE_RULES`` alone read, where "both collapse" decided the verdict; else None."""
        if self.verdict(margin) == self.verdict_fixed_before_runs(margin):
            return None
        return f"by the rules of `{SCORE_RULES}` alone it reads '{self.verdict_fixed_before_runs(margin)}'"


def paired_interval(a: str, b: str, scores_a: dict[int, float], scores_b: dict[int, float], comparisons: int,
                    alpha: float = ALPHA, collapsed_both: set[int] | frozenset[int] = frozenset()) -> Paired:
    """Paired t-interval for mean(score_a − score_b) over the seeds both arms have, Bonferroni over ``comparisons``.

    Args:
        scores_a, scores_b: {seed: primary score}.
        comparisons: m, the number of comparisons in the family (each interval gets level 1 − α/m).
        collapsed_both: seeds in which both arms met the collapse rule; when it holds every common seed
            the verdict is 'both collapse' (module docstring).

    Raises:
        ValueError: fewer than two common seeds, or comparisons < 1.
    """
    if comparisons < 1:
        raise ValueError(f"comparisons must be >= 1, got {comparisons}")
    n, m, sd = _paired_differences(a, b, scores_a, scores_b)
    half = t_quantile(1 - alpha / (2 * comparisons), n - 1) * sd / math.sqrt(n)
    seeds = set(scores_a) & set(scores_b)
    return Paired(a, b, n, m, m - half, m + half, 1 - alpha / comparisons,
                  both_collapsed=seeds <= set(collapsed_both))


def pick_tuned(grid: list[str], scores: dict[str, dict[int, float]], seeds: list[int]) -> tuple[str, dict[str, float]]:
    """The tuned baseline of ``grid``: the arm with the highest mean primary score over ``seeds`` (module docstring).

    Args:
        grid: candidate arms, in the experiment's order (the first wins a tie).
        scores: {arm: {seed: primary score}}; seeds outside ``seeds`` are ignored, so the comparison seeds
            cannot leak into the pick.
        seeds: the tuning seeds.

    Returns:
        (the picked arm, {arm: its mean over ``seeds``}).

    Raises:
        ValueError: an empty grid or no tuning seeds, or an arm lacking a score on some tuning seed (a failed or
            unfinished run: rerun ``trustbatch lab run``), so that no arm is picked on fewer seeds than another.
    """
    if not grid or not seeds:
        raise ValueError("a tuned baseline needs a non-empty grid of arms and at least one tuning seed")
    missing = [f"{a} seed {s}" for a in grid for s in seeds if s not in scores.get(a, {})]
    if missing:
        raise ValueError(f"no primary score for {', '.join(missing)}; finish those runs (rerun `trustbatch lab run`)")
    means = {a: sum(scores[a][s] for s in seeds) / len(seeds) for a in grid}
    best = max(grid, key=means.__getitem__)  # max keeps the first of equal maxima
    return best, means


def _paired_differences(a: str, b: str, scores_a: dict[int, float], scores_b: dict[int, float]) -> tuple[int, float, float]:
    """(n, mean, sd) of the per-seed differences score_a − score_b over the common seeds.

    Raises:
        ValueError: fewer than two common seeds.
    """
    seeds = sorted(set(scores_a) & set(scores_b))
    if len(seeds) < 2:
        raise ValueError(f"a paired comparison of {a} and {b} needs two common seeds, got {len(seeds)}")
    d = [scores_a[s] - scores_b[s] for s in seeds]
    n = len(d)
    m = sum(d) / n
    return n, m, math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))


def resolvable_margin(sd: float, n: int, comparisons: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest equivalence margin δ (score units) that TOST at level α/m resolves with probability ``power``
    when the true paired difference is 0: (t_{1 − α/m, n−1} + t_{1 − (1 − power)/2, n−1}) · sd/√n.

    Args:
        sd: standard deviation of the per-seed differences; n: seeds (n ≥ 2); comparisons: m, the Bonferroni family.

    Raises:
        ValueError: n < 2, comparisons < 1, or power outside (0, 1).
    """
    if n < 2 or comparisons < 1 or not 0 < power < 1:
        raise ValueError(f"resolvable_margin needs n >= 2, comparisons >= 1 and 0 < power < 1; got {n}, {comparisons}, {power}")
    return (t_quantile(1 - alpha / comparisons, n - 1) + t_quantile(1 - (1 - power) / 2, n - 1)) * sd / math.sqrt(n)


@dataclass
class Equivalence:
    """TOST of arm ``a`` against ``b`` within ±``margin`` at level ``level`` (α/m), with the design's resolvable margin."""

    a: str
    b: str
    n: int
    mean: float  # mean of score_a − score_b
    sd: float  # of the per-seed differences
    margin: float
    resolvable: float  # resolvable_margin at this n, sd and family
    p: float  # the larger of the two one-sided p-values
    level: float  # α/m: each one-sided test's level

    def verdict(self) -> str:
        """'beyond the design' (margin < resolvable) | 'equivalent' | 'not shown equivalent'."""
        if self.margin < self.resolvable:
            return "beyond the design"
        return "equivalent" if self.p < self.level else "not shown equivalent"

    def sentence(self) -> str:
        v = self.verdict()
        head = f"{self.a} − {self.b}: resolvable margin ±{self.resolvable:.3f} (paired SD {self.sd:.3f}, {self.n} seeds)"
        if v == "beyond the design":
            return f"{head}; ±{self.margin} is beyond it, so no equivalence is tested."
        return (f"{head}; TOST p = {self.p:.3g} against {self.level:.4g}: "
                + (f"**equivalent within ±{self.margin}**." if v == "equivalent" else f"not shown equivalent within ±{self.margin}."))


def tost(a: str, b: str, scores_a: dict[int, float], scores_b: dict[int, float], comparisons: int,
         margin: float = MARGIN, alpha: float = ALPHA, power: float = POWER) -> Equivalence:
    """Two one-sided paired t-tests of H0: mean(score_a − score_b) ≤ −margin and H0: ≥ +margin, each at α/m.

    p = max(P(T ≥ (mean + margin)/se), P(T ≥ (margin − mean)/se)), T ~ t_{n−1}, se = sd/√n (Schuirmann 1987). With
    sd = 0 the differences are all equal: p is 0 inside the margin, 1 outside.

    Args:
        scores_a, scores_b: {seed: primary score}; comparisons: m, the experiment's Bonferroni family.

    Raises:
        ValueError: fewer than two common seeds, comparisons < 1 (``resolvable_margin``).
    """
    from scipy.stats import t

    n, m, sd = _paired_differences(a, b, scores_a, scores_b)
    resolvable = resolvable_margin(sd, n, comparisons, alpha, power)
    if sd == 0:
        p = 0.0 if abs(m) < margin else 1.0
    else:
        se = sd / math.sqrt(n)
        p = float(max(t.sf((m + margin) / se, n - 1), t.sf((margin - m) / se, n - 1)))
    return Equivalence(a, b, n, m, sd, margin, resolvable, p, alpha / comparisons)


@dataclass
class SignedRank:
    """The two-sided Wilcoxon signed-rank test of the per-seed differences score_a − score_b."""

    a: str
    b: str
    n: int
    statistic: float  # the smaller of the positive- and negative-rank sums (scipy's two-sided statistic)
    p: float
    positive: int  # seeds with score_a > score_b
    exact: bool = True  # the exact null distribution, else the normal approximation (``signed_rank``)

    def sentence(self) -> str:
        how = "exact" if self.exact else "normal approximation"
        return (f"{self.a} − {self.b}: Wilcoxon signed-rank (sensitivity, {how}, two-sided) W = {self.statistic:g}, "
                f"p = {self.p:.3g}; {self.positive} of {self.n} seeds favour {self.a}.")


def signed_rank(a: str, b: str, scores_a: dict[int, float], scores_b: dict[int, float]) -> SignedRank:
    """Wilcoxon's signed-rank test (Wilcoxon 1945) of the paired differences over the common seeds, two-sided, with
    the exact null distribution where it holds (no ties or zero differences, n ≤ 50) and the normal approximation
    otherwise (``scipy.stats.wilcoxon``, the method chosen here and named in the sentence: scipy's ``"auto"`` picks
    by n alone in some versions).

    Raises:
        ValueError: fewer than two common seeds, or every difference zero (the test has nothing to rank).
    """
    from scipy.stats import wilcoxon

    seeds = sorted(set(scores_a) & set(scores_b))
    if len(seeds) < 2:
        raise ValueError(f"a signed-rank test of {a} and {b} needs two common seeds, got {len(seeds)}")
    d = [scores_a[s] - scores_b[s] for s in seeds]
    if all(x == 0 for x in d):
        raise ValueError(f"{a} and {b} score the same on every seed; the signed-rank test has nothing to rank")
    magnitudes = [abs(x) for x in d]
    exact = len(d) <= 50 and 0 not in magnitudes and len(set(magnitudes)) == len(magnitudes)
    with warnings.catch_warnings():  # "sample size too small for normal approximation": the sentence says which
        warnings.filterwarnings("ignore", message="Sample size too small")
        res = wilcoxon(d, alternative="two-sided", method="exact" if exact else "approx")
    return SignedRank(a, b, len(d), float(res.statistic), float(res.pvalue), sum(x > 0 for x in d), exact)


@dataclass
class Interaction:
    """The difference of differences (A1 − B1) − (A2 − B2) over the seeds all four arms share, with its interval."""

    pairs: tuple[tuple[str, str], tuple[str, str]]
    n: int
    mean: float
    lo: float
    hi: float
    edges: tuple[float, float]  # mean(A1 − B1), mean(A2 − B2) over the same seeds
    level: float = 1 - ALPHA

    def sentence(self) -> str:
        (a1, b1), (a2, b2) = self.pairs
        reading = ("the edge differs between the conditions: larger in the first" if self.lo > 0 else
                   "the edge differs between the conditions: larger in the second" if self.hi < 0 else
                   "the interval cannot tell whether the edge differs between the conditions")
        return (f"({a1} − {b1}) − ({a2} − {b2}) = {self.mean:+.3f} (edges {self.edges[0]:+.3f} and "
                f"{self.edges[1]:+.3f}), paired {100 * self.level:.0f}% interval [{self.lo:+.3f}, {self.hi:+.3f}] "
                f"over {self.n} seeds: {reading}.")


def interaction(pairs: tuple[tuple[str, str], tuple[str, str]], scores: dict[str, dict[int, float]],
                alpha: float = ALPHA) -> Interaction:
    """The objective × condition interaction as a paired difference of differences (module docstring): per seed
    dd_s = (A1(s) − B1(s)) − (A2(s) − B2(s)); the interval is mean(dd) ± t_{1 − α/2, n−1} · sd(dd)/√n.

    Args:
        pairs: ((A1, B1), (A2, B2)), the same two objectives under two conditions.
        scores: {arm: {seed: primary score}}.

    Raises:
        ValueError: an arm without scores, or fewer than two seeds that all four arms share.
    """
    (a1, b1), (a2, b2) = pairs
    missing = [x for x in (a1, b1, a2, b2) if x not in scores]
    if missing:
        raise ValueError(f"the interaction needs scores for {', '.join(missing)}")
    seeds = sorted(set.intersection(*(set(scores[x]) for x in (a1, b1, a2, b2))))
    if len(seeds) < 2:
        raise ValueError(f"the interaction needs two seeds that all four arms share, got {len(seeds)}")
    e1 = [scores[a1][s] - scores[b1][s] for s in seeds]
    e2 = [scores[a2][s] - scores[b2][s] for s in seeds]
    dd = [x - y for x, y in zip(e1, e2)]
    n = len(dd)
    m = sum(dd) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in dd) / (n - 1))
    half = t_quantile(1 - alpha / 2, n - 1) * sd / math.sqrt(n)
    return Interaction(pairs, n, m, m - half, m + half, (sum(e1) / n, sum(e2) / n), 1 - alpha)


def power_paired(delta: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test at level α with n seeds when the true mean difference is ``delta`` and
    the per-seed differences have SD ``sd``: P(|T'| > t_{1 − α/2, n−1}) with T' noncentral t, df n − 1,
    noncentrality delta/(sd/√n) (the standard planning formula, e.g. Chow, Shao & Wang, ch. 3).

    Raises:
        ValueError: n < 2 or sd <= 0.
    """
    from scipy.stats import nct

    if n < 2 or sd <= 0:
        raise ValueError(f"power_paired needs n >= 2 and sd > 0, got n={n}, sd={sd}")
    crit = t_quantile(1 - alpha / 2, n - 1)
    ncp = delta / (sd / math.sqrt(n))
    return float(nct.sf(crit, n - 1, ncp) + nct.cdf(-crit, n - 1, ncp))
