"""Ratio histograms at every optimizer step of a replayed batch (issue 14, item 8).

References: a plain forward (``response_logprobs``) of a copy of the model taken just before each optimizer
step, on the rows that step trains on, independently of the learner's own log-probs; token counts of the
batch; a real ``trustbatch train`` run's ratios.jsonl, and the same run never interrupted for a resumed one;
hand-worked histogram quantiles for the report's figure and line.
"""

import copy
import json
import re

import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.forward import pack, response_logprobs
from trustbatch.trainer.learner import Learner

from llama_rows import _llama, _rows
from tiny import TINY


def _batch():
    prompts, comps = _rows()
    packed = pack(prompts, comps, pad_id=0)
    B, C = packed.response_mask.shape
    g = torch.Generator().manual_seed(5)
    blp = -3.0 + 0.5 * torch.randn(B, C, generator=g, dtype=torch.float64)
    return TrainBatch(packed, blp, torch.randn(B, generator=g, dtype=torch.float64), torch.zeros(B, dtype=torch.long))


def test_a_rounds_maxima_are_the_largest_of_its_steps():
    """With 2 epochs × 2 mini-batches the round record averaged every metric over the steps, ``ratio_max`` too: a
    mean of maxima (the reviewer's run: 5.05 logged, 14.06 the round's largest ratio). The reference: each step's
    ratios from a plain forward of the policy just before that step; the round's maxima are the largest of them."""
    model = _llama(torch.float64)
    learner = Learner(model, "grpo", {}, lr=5e-1, grad_clip=1e9, micro_batch_size=3, epochs=2, minibatches=2)
    log_ratios = []
    inner_step = learner.step

    def step(mb_batch):
        frozen = copy.deepcopy(model).eval()
        with torch.no_grad():
            lp, _ = response_logprobs(frozen, mb_batch.packed)
        log_ratios.append((lp - mb_batch.behavior_logprobs)[mb_batch.packed.response_mask])
        return inner_step(mb_batch)

    learner.step = step
    got = learner.train_on(_batch())
    step_max = [float(x.max().exp()) for x in log_ratios]
    assert len(step_max) == 4 and max(step_max) > sum(step_max) / 4 * 1.01  # the steps' maxima differ
    assert abs(got["ratio_max"] - max(step_max)) <= 1e-6 * max(step_max)
    assert abs(got["abs_log_ratio_max"] - max(float(x.abs().max()) for x in log_ratios)) <= 1e-6
    assert got["optimizer_steps"] == 4.0


def test_each_optimizer_step_records_its_minibatch_before_the_step():
    model = _llama(torch.float64)
    learner = Learner(model, "grpo", {}, lr=5e-2, grad_clip=1e9, micro_batch_size=3, epochs=2, minibatches=2)
    got, want = [], []
    learner.on_step_ratios.append(lambda j, e, mb, lr: got.append((j, e, mb, lr.clone())))
    inner_step = learner.step

    def step(mb_batch):  # the reference: the policy before this step, on this step's rows, by a plain forward
        frozen = copy.deepcopy(model).eval()
        with torch.no_grad():
            lp, _ = response_logprobs(frozen, mb_batch.packed)
        m = mb_batch.packed.response_mask
        want.append((lp - mb_batch.behavior_logprobs)[m])
        return inner_step(mb_batch)

    learner.step = step
    batch = _batch()
    learner.train_on(batch)

    assert [(j, e, mb) for j, e, mb, _ in got] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for (j, _, _, lr), w in zip(got, want):
        # the learner may order tokens by micro-batch; compare as multisets
        assert lr.shape == w.shape, j
        assert torch.allclose(lr.sort().values.double(), w.sort().values, atol=1e-5), j
    # each epoch's two mini-batches cover the batch's tokens once
    n = int(batch.packed.response_mask.sum())
    assert got[0][3].numel() + got[1][3].numel() == n == got[2][3].numel() + got[3][3].numel()
    # the ratios move between steps (the record is not a stale pre-round copy)
    first_epoch = torch.cat([got[0][3], got[1][3]]).sort().values
    second_epoch = torch.cat([got[2][3], got[3][3]]).sort().values
    assert (first_epoch - second_epoch).abs().max() > 1e-4


def test_no_record_without_a_hook_or_outside_train_on():
    model = _llama(torch.float64)
    learner = Learner(model, "grpo", {}, lr=1e-2, micro_batch_size=4)
    calls = []
    learner.step(_batch())  # a bare step has no optimizer-step tag: nothing to record
    learner.on_step_ratios.append(lambda *a: calls.append(a))
    learner.step(_batch())
    assert calls == []


def test_train_writes_per_step_records_for_replayed_rounds(tmp_path):
    from typer.testing import CliRunner

    from trustbatch.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", *TINY, "train.steps=2", "train.epochs=2", "train.minibatches=2",
                                   f"run_dir={run}", "threads=1"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in (run / "ratios.jsonl").read_text().splitlines()]
    for round_ in (1, 2):
        pre = [r for r in recs if r["step"] == round_ and "opt_step" not in r]
        steps = [r for r in recs if r["step"] == round_ and "opt_step" in r]
        assert len(pre) == 1
        assert [(r["opt_step"], r["epoch"], r["minibatch"]) for r in steps] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
        n = sum(pre[0]["counts"])  # the round's valid tokens
        assert sum(steps[0]["counts"]) + sum(steps[1]["counts"]) == n == sum(steps[2]["counts"]) + sum(steps[3]["counts"])
        # the round's first optimizer step trains on fresh data: π_θ = μ up to float rounding, which the exact
        # quantiles must show (the 0.05-wide bins cannot); later steps have moved
        assert all(abs(v) < 1e-4 for v in steps[0]["quantiles"].values()), steps[0]["quantiles"]
        assert max(abs(v) for v in steps[3]["quantiles"].values()) > 1e-4, steps[3]["quantiles"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m.get("optimizer_steps", 4) == 4 for m in metrics if m["step"] > 0)


def test_histogram_record_has_the_exact_quantiles_of_the_unclamped_ratios(tmp_path):
    import numpy as np

    from trustbatch.trainer.runlog import log_ratio_histogram

    g = torch.Generator().manual_seed(3)
    x = 1.5 * torch.randn(7, 9, generator=g, dtype=torch.float64)  # a good share beyond the bins' ±2
    mask = torch.rand(7, 9, generator=g) < 0.7
    log_ratio_histogram(tmp_path, 4, x, mask, opt_step=1)
    rec = json.loads((tmp_path / "ratios.jsonl").read_text())
    valid = x[mask].numpy()
    for q, got in rec["quantiles"].items():
        assert abs(got - np.percentile(valid, 100 * float(q))) < 1e-12, q
    assert sum(rec["counts"]) == mask.sum()
    log_ratio_histogram(tmp_path, 5, torch.zeros(0))  # an empty mini-batch: counts, no quantiles
    assert "quantiles" not in json.loads((tmp_path / "ratios.jsonl").read_text().splitlines()[1])


def test_step_ratio_line_uses_exact_quantiles_and_says_when_it_cannot():
    from trustbatch.lab.report.tables import step_ratio_line

    edges = [round(-2.0 + 0.05 * i, 4) for i in range(81)]
    near_zero = [0] * 80
    near_zero[39], near_zero[40] = 30, 70  # tokens within 1e-7 of 0 land on both sides of the 0 edge

    def rec(j, seed_q):
        return {"step": 1, "opt_step": j, "epoch": 0, "minibatch": j, "edges": edges, "counts": near_zero,
                "quantiles": {"0.05": seed_q[0], "0.5": seed_q[1], "0.95": seed_q[2]}}

    runs = [{"ratios": [rec(0, (-1e-7, 0.0, 1e-7)), rec(1, (-0.30, -0.01, 0.10))]},
            {"ratios": [rec(0, (-2e-7, 1e-8, 2e-7)), rec(1, (-0.50, 0.03, 0.20))]},
            {"ratios": [rec(0, (-3e-7, 0.0, 3e-7)), rec(1, (-0.40, 0.02, 0.40))]}]
    line = step_ratio_line({"p3o": runs})
    # medians over the three records, by hand: step 1 → 5% −0.40, 50% +0.02, 95% +0.20
    assert "p3o: +0.000 [-0.000, +0.000] at step 0 → +0.020 [-0.400, +0.200] at step 1" in line, line
    assert "exact quantile" in line and "cannot resolve" not in line
    old = [{"ratios": [{k: v for k, v in r.items() if k != "quantiles"} for r in run["ratios"]]} for run in runs]
    coarse = step_ratio_line({"p3o": old})
    assert "cannot resolve |log ρ| < 0.05" in coarse
    # the pooled histogram interpolates inside the two bins around 0: the median 0.05·(50−30)/70 = +0.014
    assert "+0.014" in coarse, coarse


def test_histogram_quantile_hand_worked():
    from trustbatch.lab.report import histogram_quantile

    edges, counts = [0.0, 1.0, 2.0, 3.0, 4.0], [0, 10, 0, 30]
    assert histogram_quantile(edges, counts, 0.25) == 2.0  # the 10th of 40 tokens: the end of bin [1, 2)
    assert abs(histogram_quantile(edges, counts, 0.5) - (3.0 + 10 / 30)) < 1e-12  # 20th: 10 into the 30 of [3, 4)
    assert histogram_quantile(edges, counts, 0.0) == 1.0
    assert histogram_quantile(edges, [0, 0, 0, 0], 0.5) != histogram_quantile(edges, [0, 0, 0, 0], 0.5)  # nan


def test_report_draws_the_step_figure_only_for_replayed_arms(tmp_path):
    from trustbatch.lab.report.figures import step_ratio_figure

    edges = [-2.0 + 0.05 * i for i in range(81)]
    one = {"step": 1, "edges": edges, "counts": [1] * 80}
    replayed = [{**one, "opt_step": j, "epoch": j // 2, "minibatch": j % 2} for j in range(4)]
    assert step_ratio_figure("x", {"a": [{"ratios": [one]}]}, tmp_path) is None
    f = step_ratio_figure("x", {"a": [{"ratios": [one]}], "b": [{"ratios": [one, *replayed]}]}, tmp_path)
    assert f == "x_step_ratios.png" and (tmp_path / f).stat().st_size > 1000


def test_resume_redoes_a_rounds_per_step_records_once(tmp_path):
    """A crash after round 3's records but before its checkpoint: the resume redoes round 3, and its
    per-step records must be replaced, not doubled (reference: the same run never interrupted)."""
    import shutil

    from trustbatch.config import load_config
    from trustbatch.recipes import train

    args = TINY + ["train.steps=3", "train.epochs=2", "train.minibatches=2", "eval.every=1", "checkpoint_every=1",
                   "threads=1", "reward.workers=0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(load_config(None, args + [f"run_dir={ref}"]))
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "summary.json").unlink()
    train(resume=str(run), overrides=[])

    def recs(d):
        return [json.loads(x) for x in (d / "ratios.jsonl").read_text().splitlines()]

    assert recs(run) == recs(ref)
    assert sum(1 for r in recs(run) if r["step"] == 3 and "opt_step" in r) == 4
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert steps == [json.loads(x) for x in (ref / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1] * 4 + [2] * 4 + [3] * 4


def test_report_line_quotes_the_first_and_last_steps_spread():
    from trustbatch.lab.report.tables import step_ratio_line

    edges = [-2.0 + 0.05 * i for i in range(81)]
    one = {"step": 1, "edges": edges, "counts": [1] * 80}

    def at(bin_, j, n=10):  # n tokens, all in bin ``bin_``, at optimizer step j
        counts = [0] * 80
        counts[bin_] = n
        return {"step": 1, "edges": edges, "counts": counts, "opt_step": j, "epoch": j // 2, "minibatch": j % 2}

    assert step_ratio_line({"a": [{"ratios": [one]}]}) == ""
    # two seeds pooled: step 0 in bin [0, 0.05) (bin 40), step 3 in bin [0.5, 0.55) (bin 50)
    runs = [{"ratios": [one, at(40, 0), at(45, 1), at(40, 2), at(50, 3)]}, {"ratios": [at(40, 0), at(50, 3)]}]
    line = step_ratio_line({"a": [{"ratios": [one]}], "b": runs})
    # uniform inside one bin: quantile q sits at lo + q·0.05
    m = re.search(r"b: (\S+) \[(\S+), (\S+)\] at step 0 → (\S+) \[(\S+), (\S+)\] at step 3", line)
    want = [0.025, 0.0025, 0.0475, 0.525, 0.5025, 0.5475]
    assert m and all(abs(float(g) - w) <= 6e-4 for g, w in zip(m.groups(), want)), line
    assert "a:" not in line


def test_step_records_hold_each_steps_ess_kl_weight_and_zeroed_share_by_hand():
    """Per-optimizer-step traces (issue 14, item 8): each step's record against the normalized ESS
    (Σρ)² / (N Σρ²), P3O's KL weight 1 − ESS (arXiv 2605.12380, Eqs. 11–12) and the share GRPO's clip would
    zero (A > 0 and ρ > 1 + ε, or A < 0 and ρ < 1 − ε), all worked in float64 from the step's own
    log-ratios as the ``on_step_ratios`` hook sees them; and the round's record is their mean."""
    model = _llama(torch.float64)
    learner = Learner(model, "p3o", {}, lr=5e-2, grad_clip=1e9, micro_batch_size=64, epochs=2, minibatches=2,
                      diagnostics=True)
    seen = []
    learner.on_step_ratios.append(lambda j, e, mb, lr: seen.append(lr.clone().double()))
    adv_of_token = []
    inner_step = learner.step

    def step(mb_batch):  # each valid token's advantage, in the order the learner flattens the mask
        m = mb_batch.packed.response_mask
        adv_of_token.append(mb_batch.advantages[:, None].expand_as(m)[m].double())
        return inner_step(mb_batch)

    learner.step = step
    batch = _batch()
    batch.advantages = batch.advantages / batch.advantages.abs().max()
    round_metrics = learner.train_on(batch)
    recs = learner.step_records
    assert [(r["opt_step"], r["epoch"], r["minibatch"]) for r in recs] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for rec, lr, adv in zip(recs, seen, adv_of_token):
        rho = lr.exp()
        ess = float(rho.sum() ** 2 / (rho.numel() * (rho ** 2).sum()))
        assert abs(rec["ess"] - ess) < 1e-6, (rec["opt_step"], rec["ess"], ess)  # the hook hands float32 ratios
        assert abs(rec["kl_weight"] - (1.0 - ess)) < 1e-6
        for eps in (0.2, 0.4):
            zeroed = float((((adv > 0) & (rho > 1 + eps)) | ((adv < 0) & (rho < 1 - eps))).double().mean())
            assert abs(rec[f"grpo_zeroed_{eps}"] - zeroed) < 1e-12, (rec["opt_step"], eps)
        assert rec["grad_norm"] > 0
    # the batch's behaviour log-probs are not the model's: ESS < 1 at every step, and it moves between steps
    assert max(r["ess"] for r in recs) < 1 and len({round(r["ess"], 9) for r in recs}) == 4
    for k in ("ess", "kl_weight", "grad_norm", "grpo_zeroed_0.2"):
        assert abs(round_metrics[k] - sum(r[k] for r in recs) / 4) < 1e-12, k


def test_train_writes_steps_jsonl_for_replayed_rounds_only(tmp_path):
    from typer.testing import CliRunner

    from trustbatch.cli import app

    run, plain = tmp_path / "run", tmp_path / "plain"
    for d, extra in ((run, ["train.epochs=2", "train.minibatches=2", "train.diagnostics=true"]), (plain, [])):
        res = CliRunner().invoke(app, ["train", *TINY, "train.steps=2", *extra, f"run_dir={d}", "threads=1"])
        assert res.exit_code == 0, res.output
    assert not (plain / "steps.jsonl").exists()  # one optimizer step per round: metrics.jsonl is per step already
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["opt_step"], r["epoch"], r["minibatch"]) for r in steps] == [
        (s, j, j // 2, j % 2) for s in (1, 2) for j in range(4)]
    for r in steps:
        if r["opt_step"] == 0:  # the round's first step trains on its fresh batch: π_θ = μ, so ESS = 1
            assert abs(r["ess"] - 1.0) < 1e-6 and r["grpo_zeroed_0.2"] == 0.0, r
    assert min(r["ess"] for r in steps if r["opt_step"] == 3) < 1.0 - 1e-7  # later steps have moved
    rounds = {m["step"]: m for m in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())}
    for s in (1, 2):
        mine = [r for r in steps if r["step"] == s]
        assert abs(rounds[s]["grad_norm"] - sum(r["grad_norm"] for r in mine) / 4) < 1e-9


def test_trace_points_place_steps_and_round_means_on_one_optimizer_step_axis():
    from trustbatch.lab.report import trace_points

    with_steps = {"metrics": [{"step": 0, "heldout_accuracy": 0.1}, {"step": 1, "ess": 0.5, "optimizer_steps": 4.0,
                                                                      "staleness_mean": 0.0}],
                  "steps": [{"step": s, "opt_step": j, "ess": 10 * s + j} for s in (1, 2) for j in range(4)]}
    # round r's step j of 4 at (r − 1)·4 + j + 1
    assert trace_points(with_steps, "ess") == {1: 10, 2: 11, 3: 12, 4: 13, 5: 20, 6: 21, 7: 22, 8: 23}
    # a key the step records lack (a source metric) falls back to the round record at its last step
    assert trace_points(with_steps, "staleness_mean") == {4: 0.0}
    old = {"metrics": [{"step": 0}, {"step": 1, "ess": 0.9, "optimizer_steps": 16.0},
                       {"step": 2, "ess": 0.8, "optimizer_steps": 16.0}], "steps": []}
    assert trace_points(old, "ess") == {16: 0.9, 32: 0.8}
    one_step = {"metrics": [{"step": 1, "ess": 1.0}, {"step": 2, "ess": 0.99}]}
    assert trace_points(one_step, "ess") == {1: 1.0, 2: 0.99}


def test_within_round_means_are_hand_worked_per_step_index(tmp_path):
    """Seed means over rounds at each step index, then mean ± s.e. over seeds, worked by hand."""
    import math

    import pytest

    from trustbatch.lab.report import within_round
    from trustbatch.lab.report.figures import within_round_figure
    from trustbatch.lab.report.tables import within_round_lines

    def rec(step, j, ess, g):
        return {"step": step, "opt_step": j, "ess": ess, "grad_norm": g}

    a = {"steps": [rec(1, 0, 1.0, 2.0), rec(1, 1, 0.9, 4.0), rec(2, 0, 1.0, 4.0), rec(2, 1, 0.7, 8.0)]}
    b = {"steps": [rec(1, 0, 1.0, 1.0), rec(1, 1, 0.9, 3.0), rec(2, 0, 1.0, 1.0), rec(2, 1, 0.9, 3.0)]}
    js, mean, se = within_round([a, b], "ess")
    # seed a: step 1 → 1.0, step 2 → (0.9 + 0.7) / 2 = 0.8; seed b: 1.0 and 0.9
    assert js == [1, 2] and mean == pytest.approx([1.0, 0.85]) and se == pytest.approx([0.0, 0.05])
    js, mean, se = within_round([a, b], "grad_norm")
    # seed a: 3.0 and 6.0; seed b: 1.0 and 3.0 → means 2.0, 4.5; s.e. = |x − y| / 2 for two seeds
    assert mean == pytest.approx([2.0, 4.5]) and se == pytest.approx([1.0, 1.5])
    assert within_round([a], "grad_norm")[1:] == ([3.0, 6.0], [0.0, 0.0])  # one seed: no spread to show
    assert within_round([{"steps": []}], "ess") == ([], [], [])
    lines = within_round_lines({"p3o": [a, b], "onpolicy": [{"steps": []}]})
    assert lines[2] == "- p3o: ESS 1.000, 0.850; gradient norm 2.00, 4.50"
    assert not any("onpolicy" in x for x in lines)
    assert within_round_lines({"onpolicy": [{"steps": []}]}) == []
    # a key missing at step 2 of 3: the values keep their own step indices
    gap = {"steps": [rec(1, 0, 1.0, 2.0), rec(1, 1, 0.9, 4.0), {"step": 1, "opt_step": 2, "ess": 0.8}]}
    assert within_round([gap], "grad_norm")[:2] == ([1, 2], [2.0, 4.0])
    gap["steps"][1].pop("grad_norm")
    assert within_round([gap], "grad_norm")[:2] == ([1], [2.0])
    gap["steps"].append({"step": 1, "opt_step": 2, "grad_norm": 5.0})
    assert "gradient norm 1: 2.00, 3: 5.00" in within_round_lines({"g": [gap]})[2]
    assert within_round_figure("x", {"onpolicy": [{"steps": []}]}, tmp_path) is None
    f = within_round_figure("x", {"onpolicy": [{"steps": []}], "p3o": [a, b]}, tmp_path)
    assert f == "x_within_round.png" and (tmp_path / f).stat().st_size > 1000
