"""The numbers docs/lab4/README.md states, recomputed from the committed archive with numpy and scipy alone (no
``trustbatch.lab.stats``): the primary paired interval, TOST at the registered ±0.05, the exact Wilcoxon signed-rank
test by enumerating all 2^16 sign flips, the objective × temperature interaction, the collapse counts by the
registered rule worked here from its definition, and the greedy-vs-sampled caveat."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from trustbatch.lab import records

ROOT = Path(__file__).resolve().parents[2]
EXP = ROOT / "docs" / "lab4" / "archive" / "confirm_t12"
PAGE = (ROOT / "docs" / "lab4" / "README.md").read_text(encoding="utf-8")
REPORT_FILE = ROOT / "docs" / "lab4" / "report" / "README.md"
REPORT = REPORT_FILE.read_text(encoding="utf-8") if REPORT_FILE.is_file() else ""
ARMS = ("p3o@T1.2", "grpo_eps0.4@T1.2", "p3o@T1.0", "grpo_eps0.4@T1.0")
SEEDS = list(range(20, 36))

pytestmark = pytest.mark.skipif(not EXP.is_dir(), reason="Lab IV's archive is not committed yet")


def _metrics() -> dict[str, dict[int, list[dict]]]:
    """{arm: {seed: metrics.jsonl records}} read from the packed archive."""
    out = {arm: {} for arm in ARMS}
    for run in records.finished_runs(EXP):
        arm, seed = run.parent.name, int(run.name.removeprefix("seed"))
        out[arm][seed] = [json.loads(line) for line in records.read_text(run / "metrics.jsonl").splitlines() if line]
    return out


def _primary(ms: list[dict]) -> float:  # registration: the mean of the round-25 and round-50 held-out pass@1
    ev = {m["step"]: m["heldout_accuracy"] for m in ms if "heldout_accuracy" in m}
    return (ev[25] + ev[50]) / 2


def _collapsed(ms: list[dict]) -> bool:
    """The registered rule (stats.py of 65a2513), worked from its words: the primary score below half of the round-0
    score, or the training reward's trailing 10-round mean ending below half of its peak."""
    base = next(m["heldout_accuracy"] for m in ms if m["step"] == 0)
    if _primary(ms) < 0.5 * base:
        return True
    r = np.array([m["reward_mean"] for m in ms if m["step"] > 0 and "reward_mean" in m])
    smooth = np.array([r[max(0, i - 9):i + 1].mean() for i in range(len(r))])
    return bool(smooth.max() > 0 and smooth[-1] < 0.5 * smooth.max())


@pytest.fixture(scope="module")
def scores():
    m = _metrics()
    assert {arm: sorted(m[arm]) for arm in ARMS} == {arm: SEEDS for arm in ARMS}  # no seed dropped or added
    return m, {arm: np.array([_primary(m[arm][s]) for s in SEEDS]) for arm in ARMS}


def _interval(d: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    from scipy.stats import t

    half = t.ppf(0.5 + level / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean(), d.mean() - half, d.mean() + half


def _signed_rank_p(d: np.ndarray) -> float:
    """Exact two-sided p of the Wilcoxon signed-rank statistic: every one of the 2^n sign assignments of the ranks
    of |d| (average ranks for ties, zeros dropped), as likely under the null."""
    from scipy.stats import rankdata

    d = d[d != 0]
    ranks = rankdata(np.abs(d))
    w = ranks[d > 0].sum()
    centre = ranks.sum() / 2
    signs = np.array(list(itertools.product((0, 1), repeat=len(d))))
    null = signs @ ranks
    return float((np.abs(null - centre) >= abs(w - centre) - 1e-9).mean())


def test_the_primary_interval_tost_and_wilcoxon(scores):
    from scipy.stats import t

    _, s = scores
    d = s["p3o@T1.2"] - s["grpo_eps0.4@T1.2"]
    mean, lo, hi = _interval(d)
    line = f"{mean:+.3f}, 95 % interval [{lo:+.3f}, {hi:+.3f}]"
    assert line in PAGE, line
    assert f"= {mean:+.3f}, paired 95.00% interval [{lo:+.3f}, {hi:+.3f}] over 16 seeds" in REPORT
    se, df = d.std(ddof=1) / 4, 15
    tost = max(t.sf((mean + 0.05) / se, df), t.cdf((mean - 0.05) / se, df))
    assert f"TOST p = {tost:.3f}" in PAGE, tost
    p = _signed_rank_p(d)
    assert f"Wilcoxon signed-rank p = {p:.3g}" in PAGE, p
    assert f"paired SD {d.std(ddof=1):.3f}" in PAGE


def test_the_interaction(scores):
    _, s = scores
    dd = (s["p3o@T1.2"] - s["grpo_eps0.4@T1.2"]) - (s["p3o@T1.0"] - s["grpo_eps0.4@T1.0"])
    mean, lo, hi = _interval(dd)
    assert f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]" in PAGE, (mean, lo, hi)
    on = s["p3o@T1.0"] - s["grpo_eps0.4@T1.0"]
    assert "on-policy edge {:+.3f} [{:+.3f}, {:+.3f}]".format(*_interval(on)) in PAGE


def test_collapse_counts(scores):
    m, _ = scores
    for arm in ARMS:
        k = sum(_collapsed(m[arm][s]) for s in SEEDS)
        assert f"`{arm}` {k}/16" in PAGE, (arm, k)


def test_how_many_runs_end_below_their_base_greedy():
    summaries = [json.loads(records.read_text(run / "summary.json")) for run in records.finished_runs(EXP)]
    assert len(summaries) == 64
    below = sum(s["final_heldout_greedy_accuracy"] < s["base_heldout_greedy_accuracy"] for s in summaries)
    assert f"{below} of the 64 runs end with a lower greedy held-out accuracy than their base" in PAGE, below


def test_what_the_shift_costs_each_objective(scores):
    _, s = scores
    for arm, label in (("grpo_eps0.4", "GRPO ε = 0.4"), ("p3o", "P3O")):
        cost = "{:+.3f} [{:+.3f}, {:+.3f}]".format(*_interval(s[f"{arm}@T1.2"] - s[f"{arm}@T1.0"]))
        assert f"{label}: {cost.replace('-', '−')}" in PAGE, (label, cost)


def test_the_bases_greedy_accuracy():
    bases = {run.name: json.loads(records.read_text(run / "summary.json"))["base_heldout_greedy_accuracy"]
             for run in records.finished_runs(EXP)}
    assert len(bases) == 16
    v = list(bases.values())
    assert f"bases {min(v):.3f}–{max(v):.3f} greedy, {sum(v) / 16:.3f} on average" in PAGE
