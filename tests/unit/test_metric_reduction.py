"""Declared metric reductions (objectives.metrics) against the same quantities computed over the whole batch."""

import pytest
import torch

from trustbatch import objectives
from trustbatch.objectives import MAX, SUM, TOKEN_MEAN, MetricReducer, RatioOf, RatioStats
from trustbatch.objectives.metrics import declare

SPLITS = (slice(0, 1), slice(1, 4), slice(4, 9))  # three uneven micro-batches of a 9-row batch


def _rows(seed=0, B=9, T=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, :2] = True  # the one-row micro-batch has tokens
    mask[5] = False  # and one row has none
    return mask, torch.randn(B, T, generator=g, dtype=torch.float64)


def test_each_reduction_gives_the_whole_batch_value_from_uneven_micro_batches():
    """Token mean over 3 uneven micro-batches == the mean over all tokens; max == max; a ratio of sums == Σx / Σy
    over every token; a sum of per-call shares of a global total == that total. Brute force over the whole batch."""
    mask, x = _rows()
    y = x.abs() + 0.1
    n_all = float(mask.sum())
    red = MetricReducer({"x_mean": TOKEN_MEAN, "x_max": MAX, "xy": RatioOf("x_share", "y_share"),
                         "x_share": TOKEN_MEAN, "y_share": TOKEN_MEAN, "x_total": SUM})
    for s in SPLITS:
        m, xs, ys = mask[s], x[s], y[s]
        n = float(m.sum())
        red.add({"x_mean": float(xs[m].sum()) / max(n, 1.0), "x_max": float(xs[m].max()) if n else float("-inf"),
                 "xy": float(xs[m].sum() / ys[m].sum()) if n else 0.0,  # the per-call ratio, which must not be averaged
                 "x_share": float(xs[m].sum()) / max(n, 1.0), "y_share": float(ys[m].sum()) / max(n, 1.0),
                 "x_total": float(xs[m].sum()) / n_all}, n)
    got = red.result(n_all)
    flat_x, flat_y = x[mask], y[mask]
    assert got["x_mean"] == pytest.approx(float(flat_x.mean()), rel=1e-12)
    assert got["x_max"] == float(flat_x.max())
    assert got["xy"] == pytest.approx(float(flat_x.sum() / flat_y.sum()), rel=1e-12)
    per_call_mean = sum(float(x[s][mask[s]].sum() / y[s][mask[s]].sum()) for s in SPLITS) / 3
    assert abs(got["xy"] - per_call_mean) > 1e-3  # the averaged per-call ratio would have been wrong here
    assert got["x_total"] == pytest.approx(float(flat_x.sum()) / n_all, rel=1e-12)


def test_a_metric_without_a_declared_reduction_is_refused():
    red = MetricReducer({"loss": SUM}, "toy")
    with pytest.raises(KeyError, match="toy reports metric 'surprise'"):
        red.add({"loss": 1.0, "surprise": 2.0}, 3.0)


def test_a_declaration_is_checked_at_registration():
    with pytest.raises(ValueError, match="register\\('toy'\\).*'num' must be a declared 'token_mean'"):
        declare("toy", {"r": RatioOf("num", "loss")})
    with pytest.raises(ValueError, match="'loss' is declared as 'sum' and as 'max'"):
        declare("toy", {"loss": MAX})
    with pytest.raises(ValueError, match="reduction 'median'"):
        declare("toy", {"q": "median"})


def _p3o_call(lp, blp, adv, mask, **kw):
    return objectives.get("p3o")(lp, blp, adv, mask, **kw).metrics


def test_p3o_metrics_reduced_over_micro_batches_equal_the_whole_batch_call():
    """p3o's declared reductions: its metrics from three uneven micro-batches (the global token count and the batch
    ESS passed, as the learner does) equal one call on the whole batch; the quantiles alone are per-call statistics."""
    mask, x = _rows(1)
    blp = -1.0 - x.abs()
    lp = blp + 0.4 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    adv = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    n_all = float(mask.sum())
    stats = RatioStats.from_logprobs(lp, blp, mask)
    whole = _p3o_call(lp, blp, adv, mask, ess=stats)
    red = MetricReducer(objectives.spec("p3o").metrics, "p3o")
    for s in SPLITS:
        red.add(_p3o_call(lp[s], blp[s], adv[s], mask[s], ess=stats, num_tokens=n_all), float(mask[s].sum()))
    got = red.result(n_all)
    assert 0 < whole["cap_weight_removed"] < 1 and whole["ess"] < 0.99  # the cap and the KL term both act
    assert set(got) == set(whole)
    for k, v in whole.items():
        if k not in ("ratio_p50", "ratio_p99"):
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def _reported(name, **kw):
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(3, 6, generator=g) > 0.2
    blp = -torch.rand(3, 6, generator=g, dtype=torch.float64) - 0.5
    lp = blp + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    if objectives.spec(name).needs_proximal:
        kw["proximal_logprobs"] = blp + 0.1
    return objectives.get(name)(lp, blp, torch.randn(3, generator=g, dtype=torch.float64), mask, **kw).metrics


@pytest.mark.parametrize("name", objectives.names())
def test_every_metric_an_objective_reports_is_declared(name):
    """Under the options that add metrics (corrections, caps, regularisers), nothing reported lacks a reduction."""
    spec = objectives.spec(name)
    extra = {"ref_logprobs": torch.full((3, 6), -1.0, dtype=torch.float64), "ref_kl_coef": 0.1,
             "entropy": torch.ones(3, 6, dtype=torch.float64)}
    variants = [{}, extra]
    if "correction" in spec.options:
        old = {"old_logprobs": torch.full((3, 6), -0.9, dtype=torch.float64)}
        variants += [{**old, "correction": "tis_token"}, {**old, "correction": "mis_token"}]
    if "behavior_weight_cap" in spec.options:
        variants.append({"behavior_weight_cap": 1.5})
    for kw in variants:
        undeclared = set(_reported(name, **kw)) - set(spec.metrics)
        assert not undeclared, (kw.keys(), undeclared)
