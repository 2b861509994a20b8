"""The report's base fingerprints: which experiments ran on which SFT bases, and a warning where an experiment's
arms did not start from the same base (hand-written run folders; the labels and lines worked out by hand)."""

import json

import pytest
import yaml

from trustbatch.lab.report import base_fingerprints, base_sets, base_table, experiment_section, mixed_bases


def _run(root, exp, arm, seed, base, finals=(0.3, 0.3), summary=True, first_step=0):
    """One finished run: held-out pass@1 ``base`` at round ``first_step``, then ``finals`` at rounds 2 and 4."""
    d = root / exp / arm / f"seed{seed}"
    d.mkdir(parents=True)
    recs = [{"step": first_step, "heldout_accuracy": base}]
    for step in (1, 2, 3, 4):
        r = {"step": step, "reward_mean": 0.5, "ess": 1.0, "grpo_zeroed_0.2": 0.0, "grad_norm": 1.0}
        if step in (2, 4):
            r["heldout_accuracy"] = finals[step // 2 - 1]
        recs.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if summary:
        (d / "summary.json").write_text(json.dumps({"wall_s": 60.0}))


def test_experiments_get_one_label_per_base_set_and_a_mixed_one_is_named(tmp_path):
    for arm in ("onpolicy", "p3o"):
        _run(tmp_path, "a", arm, 0, 0.20)
        _run(tmp_path, "a", arm, 1, 0.30)
    _run(tmp_path, "b", "x", 0, 0.20)  # shares seed 0 with a, and adds seed 2
    _run(tmp_path, "b", "x", 2, 0.40)
    _run(tmp_path, "c", "x", 0, 0.25)  # seed 0 rebuilt differently
    _run(tmp_path, "d", "p", 0, 0.20)
    _run(tmp_path, "d", "q", 0, 0.25)  # arms on different bases
    _run(tmp_path, "e", "x", 5, 0.50)  # shares no seed with anything
    _run(tmp_path, "e", "x", 6, 0.50, summary=False)  # unfinished: ignored
    _run(tmp_path, "e", "y", 5, 0.70, first_step=2)  # no round-0 evaluation: no fingerprint
    prints = {n: base_fingerprints(tmp_path / n) for n in "abcde"}
    assert prints["a"] == {0: {"onpolicy": 0.20, "p3o": 0.20}, 1: {"onpolicy": 0.30, "p3o": 0.30}}
    assert prints["e"] == {5: {"x": 0.50}}
    assert mixed_bases(prints["a"]) == {} and mixed_bases(prints["d"]) == {0: {"p": 0.20, "q": 0.25}}
    assert base_sets(prints) == {"a": "A", "b": "A", "c": "B", "d": "mixed", "e": "C"}
    # b joined A and brought seed 2; a later experiment that disagrees there is another set
    _run(tmp_path, "f", "x", 2, 0.41)
    assert base_sets({**prints, "f": base_fingerprints(tmp_path / "f")})["f"] == "D"
    rows = [x for x in base_table(prints) if x.startswith("| ") and not x.startswith("| experiment")]
    assert rows == ["| a | A | 0: 0.2000, 1: 0.3000 |", "| b | A | 0: 0.2000, 2: 0.4000 |",
                    "| c | B | 0: 0.2500 |", "| d | mixed | 0: 0.2000/0.2500 |", "| e | C | 5: 0.5000 |"]
    assert base_table({"z": {}}) == []
    # a stray folder, a torn line before the first evaluation, and a base score of NaN or null: no crash, no print
    _run(tmp_path, "g", "x", 0, 0.20)
    (tmp_path / "g" / "x" / "seed0_old").mkdir()
    (tmp_path / "g" / "x" / "seed0_old" / "summary.json").write_text("{}")
    m = tmp_path / "g" / "x" / "seed0" / "metrics.jsonl"
    m.write_text('{"step": 0, "reward_me\n' + m.read_text())
    _run(tmp_path, "g", "y", 0, float("nan"))
    _run(tmp_path, "g", "z", 0, 0.0)
    z = tmp_path / "g" / "z" / "seed0" / "metrics.jsonl"
    z.write_text(z.read_text().replace('"heldout_accuracy": 0.0', '"heldout_accuracy": null', 1))
    assert base_fingerprints(tmp_path / "g") == {0: {"x": 0.20}}
    assert base_sets({"a": prints["a"], "g": base_fingerprints(tmp_path / "g")}) == {"a": "A", "g": "A"}


# The report's own words, not matplotlib's, for runs without ratios. Only this warning is an error: matplotlib 3.8
# with pyparsing >= 3.3 warns (a UserWarning) on its first mathtext parse, whichever test makes it.
@pytest.mark.filterwarnings("error:No artists with labels found:UserWarning")
def test_experiment_section_warns_and_marks_the_pairs_whose_bases_differ(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    (tmp_path / "out").mkdir()
    (exp / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p3o": {}, "grpo": {}, "onpolicy": {}},
                                                         "compare": [["p3o", "grpo"], ["p3o", "onpolicy"]]}))
    for seed, (b_p3o, b_grpo) in enumerate([(0.2, 0.2), (0.2, 0.25), (0.3, 0.3)]):
        _run(tmp_path, "exp", "p3o", seed, b_p3o, finals=(0.30 + 0.01 * seed, 0.31))
        _run(tmp_path, "exp", "grpo", seed, b_grpo, finals=(0.29, 0.30 - 0.01 * seed))
        _run(tmp_path, "exp", "onpolicy", seed, b_p3o, finals=(0.30, 0.30))
    text, findings = experiment_section("exp", exp, tmp_path / "out")
    assert "**Mixed bases:**" in text and "seed 1: grpo 0.2500, onpolicy 0.2000, p3o 0.2000" in text
    assert findings[0].endswith("(bases differ at seeds [1]: not a clean pairing)")
    assert "bases differ" not in findings[1]  # p3o and onpolicy share every base
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p3o": {}, "grpo": {}}}))
    for seed in range(3):
        for arm in ("p3o", "grpo"):
            _run(tmp_path, "clean", arm, seed, 0.2 + seed / 10)
    text, findings = experiment_section("clean", clean, tmp_path / "out")
    assert "Mixed bases" not in text and not any("bases differ" in f for f in findings)
    # tuning seeds pick the tuned baseline and are never paired: a different base there is no warning
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p3o": {}, "grpo": {}},
                                                           "tune": {"arms": ["grpo"], "seeds": [9]}}))
    for seed in range(3):
        for arm in ("p3o", "grpo"):
            _run(tmp_path, "tuned", arm, seed, 0.2)
    _run(tmp_path, "tuned", "grpo", 9, 0.5)
    _run(tmp_path, "tuned", "p3o", 9, 0.6)
    text, findings = experiment_section("tuned", tuned, tmp_path / "out")
    assert "Mixed bases" not in text and not any("bases differ" in f for f in findings)
    assert mixed_bases(base_fingerprints(tuned)) == {9: {"grpo": 0.5, "p3o": 0.6}}  # the report-wide table sees it


@pytest.mark.filterwarnings("error:No artists with labels found:UserWarning")
def test_the_arms_legend_goes_on_the_first_panel_that_has_data(tmp_path, monkeypatch):
    """Runs that never logged ESS (the traces' first panel) still get the arms' legend, on the first panel with a
    curve (the GRPO-zeroed share, fifth), and no matplotlib warning; the ratio histograms, with no ratio records
    at all, get none."""
    from trustbatch.lab.report import figures

    legends, save = {}, figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, out, fname: (
        legends.__setitem__(fname, [ax.get_legend() is not None for ax in fig.axes]), save(fig, out, fname))[1])
    exp = tmp_path / "exp"
    exp.mkdir()
    (tmp_path / "out").mkdir()
    (exp / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p3o": {}, "grpo": {}}}))
    for seed in range(2):
        for arm in ("p3o", "grpo"):
            _run(tmp_path, "exp", arm, seed, 0.2)
            m = exp / arm / f"seed{seed}" / "metrics.jsonl"
            m.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "ess"}) + "\n"
                                 for line in m.read_text().splitlines()))
    experiment_section("exp", exp, tmp_path / "out")
    assert legends["exp_curves.png"] == [True, False]
    assert legends["exp_traces.png"] == [False, False, False, False, True, False, False]
    assert not any(legends["exp_ratios.png"])
