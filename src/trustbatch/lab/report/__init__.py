"""``trustbatch lab report``: pre-flight table, dose–response, curves, per-step traces, ratio histograms, verdicts.

Everything in the report is computed from the run directories; the findings are the rules of
``trustbatch.lab.stats`` applied to the numbers, not hand-written. Whether each rule was fixed before an
experiment's runs or is post hoc is computed from git ancestry (``provenance.rule_standing``), and the header's
settings from the runs' own configs.

Modules: ``runs`` (reading the runs, the numbers over seeds), ``figures`` (matplotlib), ``tables`` (Markdown lines),
``provenance`` (commits, rule labels, calls, cost, base fingerprints), ``header`` (the opening: settings and rule
labels), ``compose`` (one section, the whole report).
"""

from .compose import experiment_section, write_report
from .provenance import (base_fingerprints, base_sets, descends, experiment_cost, git_commit, mixed_bases, rule_standing,
                         run_commits)
from .runs import arm_scores, histogram_quantile, load_runs, run_scores, trace_points, within_round
from .tables import base_table, cost_table, preflight_summary

__all__ = ["arm_scores", "base_fingerprints", "base_sets", "base_table", "cost_table", "descends", "experiment_cost",
           "experiment_section", "git_commit", "histogram_quantile", "load_runs", "mixed_bases", "preflight_summary",
           "rule_standing", "run_commits", "run_scores", "trace_points", "within_round", "write_report"]
