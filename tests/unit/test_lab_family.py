"""The comparison family of a lab report is the registered one, whatever finished; runs left out are named.

A pair whose arm has no finished runs stays in the Bonferroni family, "not compared": dropping it loosened the level
of the others (3 registered, 2 counted: a 97.5% interval where 98.33% was registered), which could turn "cannot tell"
into a win. The reference intervals are scipy's paired t-intervals at the registered family size.
"""

import json

import pytest
import yaml
from scipy import stats

from trustbatch.errors import UserError
from trustbatch.lab.experiment import load_experiment
from trustbatch.lab.report import write_report

from lab_runs import write_runs

P = [0.62, 0.60, 0.64, 0.61, 0.63, 0.62]
G1 = [0.60, 0.60, 0.60, 0.60, 0.60, 0.60]


def _report(tmp_path, finals: dict, spec: dict) -> str:
    exp = tmp_path / "runs" / "e"
    write_runs(exp, finals)
    (exp / "experiment.yaml").write_text(yaml.safe_dump(spec))
    return exp, write_report(tmp_path / "runs", tmp_path / "r", figures="none").read_text()


def test_an_arm_without_runs_keeps_its_place_in_the_family(tmp_path):
    spec = {"arms": {"p": {}, "g1": {}, "g2": {}, "g3": {}}, "compare": [["p", "g1"], ["p", "g2"], ["p", "g3"]]}
    _, text = _report(tmp_path, {"p": P, "g1": G1, "g2": G1}, spec)
    assert "Bonferroni over 3" in text and "- p vs g3: not compared (arm g3 has no finished runs)." in text
    registered = stats.ttest_rel(P, G1).confidence_interval(1 - 0.05 / 3)
    loosened = stats.ttest_rel(P, G1).confidence_interval(1 - 0.05 / 2)
    assert registered.low < 0 < loosened.low  # the case where the family's size decides the verdict
    line = next(x for x in text.splitlines() if x.startswith("- p − g1"))
    assert f"98.33% interval [{registered.low:+.3f}, {registered.high:+.3f}]" in line and "cannot tell" in line


def test_finished_runs_that_cannot_be_scored_are_named_and_compared_nowhere(tmp_path):
    finals = {"p": P, "g1": G1}
    exp = tmp_path / "runs" / "e"
    write_runs(exp, finals)
    one_eval = exp / "p" / "seed2" / "metrics.jsonl"
    rows = [json.loads(x) for x in one_eval.read_text().splitlines()]
    rows[2].pop("heldout_accuracy")  # one held-out evaluation after round 0 (a primary score needs two)
    one_eval.write_text("".join(json.dumps(r) + "\n" for r in rows))
    no_base = exp / "p" / "seed3" / "metrics.jsonl"
    no_base.write_text("".join(x + "\n" for x in no_base.read_text().splitlines()[1:]))  # no round-0 evaluation
    (exp / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p": {}, "g1": {}}, "compare": [["p", "g1"]]}))
    text = write_report(tmp_path / "runs", tmp_path / "r", figures="none").read_text()
    assert ("Finished but not scored, so in no comparison: p seed 2 (a primary score needs two held-out evaluations "
            "after round 0, got 1); p seed 3 (the collapse rule needs the round-0 (base) evaluation of the run).") in text
    keep = [0, 1, 4, 5]
    want = stats.ttest_rel([P[s] for s in keep], [G1[s] for s in keep]).confidence_interval(0.95)
    assert f"interval [{want.low:+.3f}, {want.high:+.3f}] over 4 seeds" in text


def test_a_registered_pair_naming_a_preflight_only_arm_is_refused(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({"arms": {"p": {}, "g": {}}, "preflight_only": ["g"], "compare": [["p", "g"]]}))
    with pytest.raises(UserError, match=r"'compare' pair \['p', 'g'\] names a preflight_only arm"):
        load_experiment(str(f))
