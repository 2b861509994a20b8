"""Issue 47 item 3: a rule is "fixed before the runs" exactly when its commit is an ancestor of every run's recorded
commit. Checked in a throwaway git repository whose ancestry the test builds, through the real report."""

import json
import subprocess

import pytest
import yaml

from trustbatch.lab.report import header, rule_standing, write_report
from trustbatch.lab.report import compose

from lab_runs import write_runs


def _git(repo, *args) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def history(tmp_path, monkeypatch):
    """run_old ← rule ← run_new, and side ← run_old on a branch: {name: short commit}; GIT_DIR points at it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    commits = {}
    for name in ("run_old", "rule", "run_new"):
        _git(repo, "commit", "-q", "--allow-empty", "-m", name)
        commits[name] = _git(repo, "rev-parse", "--short", "HEAD")
    _git(repo, "checkout", "-q", "-b", "side", commits["run_old"])
    _git(repo, "commit", "-q", "--allow-empty", "-m", "side")
    commits["side"] = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))  # what provenance.descends asks git about
    return commits


def test_a_rule_is_fixed_before_exactly_the_runs_made_at_its_descendants(history):
    rule = history["rule"]
    assert rule_standing(rule, [history["run_new"]]) is True
    assert rule_standing(rule, [rule]) is True  # a run at the rule's own commit: the rule was there
    assert rule_standing(rule, [history["run_old"]]) is False  # the rule is younger than the run: post hoc
    assert rule_standing(rule, [history["run_new"], history["side"]]) is False  # one run off its line is enough
    assert rule_standing(rule, [history["run_new"], None]) is None  # a call that recorded no commit
    assert rule_standing(rule, []) is None
    assert rule_standing(rule, ["0123456789abcdef"]) is None  # git cannot say


def _experiment(root, commit, registered=None):
    """Two arms × two seeds with fixed held-out scores (P3O ahead by 0.10 and 0.12), one call at ``commit``."""
    exp = root / "e"
    write_runs(exp, {"p3o@x": [0.60, 0.62], "grpo@x": [0.50, 0.50]})
    spec = {"arms": {"p3o@x": {}, "grpo@x": {}}, "compare": [["p3o@x", "grpo@x"]], "commit": commit}
    (exp / "experiment.yaml").write_text(yaml.safe_dump(spec | ({"registered": registered} if registered else {})))
    (exp / "calls.jsonl").write_text(json.dumps({"start": 0.0, "end": 60.0, "commit": commit, "seeds": [0, 1]}) + "\n")
    return root


def _equivalence_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("**Equivalence**"))


def test_the_report_labels_rules_by_ancestry_not_by_a_registered_key(history, tmp_path, monkeypatch):
    rule = history["rule"]
    monkeypatch.setattr(compose, "EQUIVALENCE_RULE", rule)
    monkeypatch.setattr(header, "RULES", {"equivalence (TOST)": rule})
    # runs made before the rule existed, in an experiment whose `registered:` commit is younger than the rule
    old = _experiment(tmp_path / "old", history["run_old"], registered=history["run_new"])
    text = write_report(old, tmp_path / "r1", figures="none").read_text()
    assert _equivalence_line(text).startswith(f"**Equivalence** (rule of `{rule}`, post hoc)")
    assert f"| equivalence (TOST) | `{rule}` | – | e | – |" in text
    # runs made after it, with no `registered:` key at all
    new = _experiment(tmp_path / "new", history["run_new"])
    text = write_report(new, tmp_path / "r2", figures="none").read_text()
    assert _equivalence_line(text).startswith(f"**Equivalence** (rule of `{rule}`, fixed before these runs)")
    assert f"| equivalence (TOST) | `{rule}` | e | – | – |" in text
    # a call that recorded no commit: not known
    (new / "e" / "calls.jsonl").write_text(json.dumps({"legacy_wall_s": 60.0}) + "\n")
    text = write_report(new, tmp_path / "r3", figures="none").read_text()
    assert "not known to precede these runs" in _equivalence_line(text)


def test_the_header_states_the_runs_own_settings(history, tmp_path):
    runs = _experiment(tmp_path / "runs", history["run_new"])
    for arm in ("p3o@x", "grpo@x"):
        for seed in (0, 1):
            cfg = {"train": {"steps": 4, "epochs": 1, "minibatches": 1}, "rollout": {"prompts_per_step": 16, "group_size": 4},
                   "eval": {"every": 2, "samples_per_prompt": 2}, "task": {"heldout_size": 32}}
            (runs / "e" / arm / f"seed{seed}.yaml").write_text(yaml.safe_dump(cfg))
    text = write_report(runs, tmp_path / "r", figures="none").read_text()
    assert "| e | 0, 1 | 4 | 4 rounds × 16 prompts × 4 samples, held-out 32 × 2 every 2 rounds |" in text
    assert "100 rounds" not in text  # the lab's default settings are not what these runs ran


def test_a_registered_analysis_the_folders_copy_lacks_is_read_from_the_registration_commit(tmp_path, monkeypatch):
    """Lab IV's runs were written by a runner that dropped ``wilcoxon``, ``interaction`` and ``equivalence_margin``
    from the folder's experiment.yaml: the report reads them from the experiment's YAML at the registration commit,
    and says so; a copy that has them is read as it is."""
    repo = tmp_path / "repo"
    (repo / "src/trustbatch/lab/experiments").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "src/trustbatch/lab/experiments/e.yaml").write_text(yaml.safe_dump(
        {"arms": {"p3o@x": {}, "grpo@x": {}}, "wilcoxon": True, "equivalence_margin": 0.05}))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "registration")
    registered = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    root = _experiment(tmp_path / "runs", registered, registered=registered)
    text = write_report(root, tmp_path / "r1", figures="none").read_text()
    assert (f"The analysis keys `equivalence_margin`, `wilcoxon` are read from `src/trustbatch/lab/experiments/e.yaml` "
            f"at the registration commit `{registered}`") in text
    assert "**Sensitivity: Wilcoxon signed-rank**" in text and "'Equivalent within ±0.05'" in _equivalence_line(text)
    spec = yaml.safe_load((root / "e" / "experiment.yaml").read_text())
    (root / "e" / "experiment.yaml").write_text(yaml.safe_dump(spec | {"wilcoxon": True, "equivalence_margin": 0.05}))
    text = write_report(root, tmp_path / "r2", figures="none").read_text()
    assert "are read from" not in text and "Post hoc" not in text and "'Equivalent within ±0.05'" in text


def test_a_registered_design_edited_after_the_runs_is_post_hoc_and_the_registered_one_is_analysed(tmp_path, monkeypatch):
    """``lab run`` copies the YAML it runs into the folder; an edit after the results (another primary pair, a
    wider margin, no Wilcoxon, a seed added) must not be analysed as registered: the report names each change as
    post hoc and analyses the registration commit's design, on its seeds only."""
    repo = tmp_path / "repo"
    (repo / "src/trustbatch/lab/experiments").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    design = {"arms": {"p3o@x": {}, "grpo@x": {}, "p3o@y": {}}, "seeds": [0, 1], "compare": [["p3o@x", "grpo@x"]],
              "wilcoxon": True, "equivalence_margin": 0.05}
    (repo / "src/trustbatch/lab/experiments/e.yaml").write_text(yaml.safe_dump(design))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "registration")
    registered = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    root = tmp_path / "runs"
    # seed 2 (added later) would turn the mean difference p3o@x − grpo@x from +0.110 into +0.040
    write_runs(root / "e", {"p3o@x": [0.60, 0.62, 0.20], "grpo@x": [0.50, 0.50, 0.30], "p3o@y": [0.5, 0.5, 0.5]})
    (root / "e" / "experiment.yaml").write_text(yaml.safe_dump(
        {**design, "seeds": [0, 1, 2], "compare": [["p3o@y", "grpo@x"]], "wilcoxon": False, "equivalence_margin": 0.2,
         "registered": registered, "commit": registered}))
    (root / "e" / "calls.jsonl").write_text(json.dumps({"start": 0.0, "end": 60.0, "commit": registered,
                                                        "seeds": [0, 1, 2]}) + "\n")
    text = write_report(root, tmp_path / "r", figures="none").read_text()
    post = next(line for line in text.splitlines() if line.startswith("**Post hoc, not analysed:**"))
    for said in ('`seeds` [0, 1, 2] where the registration has [0, 1]',
                 '`compare` [["p3o@y", "grpo@x"]] where the registration has [["p3o@x", "grpo@x"]]',
                 "`wilcoxon` false where the registration has true",
                 "`equivalence_margin` 0.2 where the registration has 0.05"):
        assert said in post, said
    assert "p3o@x − grpo@x = +0.110" in text and "p3o@y − grpo@x" not in text  # the registered pair, seeds 0 and 1
    assert "**Sensitivity: Wilcoxon signed-rank**" in text and "'Equivalent within ±0.05'" in _equivalence_line(text)


def test_lab_run_writes_the_analysis_keys_into_the_folders_experiment_yaml(tmp_path):
    from trustbatch.lab.experiment import load_experiment
    from trustbatch.lab.runner import _write_spec

    src = tmp_path / "e.yaml"
    analysis = {"equivalence_margin": 0.05, "wilcoxon": True, "interaction": [["a", "b"], ["c", "d"]]}
    src.write_text(yaml.safe_dump({"arms": {k: {} for k in "abcd"}, "seeds": [0], **analysis}))
    _write_spec(load_experiment(str(src)), tmp_path, "abc1234", "trustbatch lab run e.yaml")
    written = yaml.safe_load((tmp_path / "experiment.yaml").read_text())
    assert {k: written.get(k) for k in analysis} == analysis
