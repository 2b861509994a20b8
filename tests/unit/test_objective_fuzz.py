"""Seeded fuzz over every registered objective: a ValueError, or a finite loss and a finite gradient.

No silent NaN or inf (trustbatch.objectives._common): whatever the inputs (dtypes float32, float16,
bfloat16, float64; empty rows, all-masked batches, zero-size batches; extreme log-probs; NaN and inf
at masked positions; huge advantages; num_tokens 0 or tiny; every correction, aggregation, KL
estimator and ESS form), a call either raises ValueError or returns a loss and a gradient w.r.t.
``logprobs`` that are both finite. The default suite runs 3,000 cases; ``-m slow`` runs 30,000.
"""

import math
import random

import pytest
import torch

from trustbatch import objectives
from trustbatch.objectives import RatioStats

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NASTY = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]


def _mask(rng: random.Random, B: int, T: int) -> torch.Tensor:
    style = rng.choice(["random", "random", "all", "none", "empty_rows", "one"])
    if style == "all":
        return torch.ones(B, T, dtype=torch.bool)
    if style == "none":
        return torch.zeros(B, T, dtype=torch.bool)
    m = torch.tensor([[rng.random() < 0.6 for _ in range(T)] for _ in range(B)], dtype=torch.bool).reshape(B, T)
    if style == "empty_rows" and B:
        m[rng.randrange(B)] = False
    if style == "one" and B and T:
        m[:] = False
        m[rng.randrange(B), rng.randrange(T)] = True
    return m


def _logprobs(rng: random.Random, g: torch.Generator, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, behavior_logprobs) in float64 before the cast; some cases extreme."""
    style = rng.choice(["normal", "normal", "on_policy", "far", "extreme", "zero"])
    blp = -torch.rand(B, T, generator=g, dtype=torch.float64) * rng.choice([0.1, 3.0, 30.0])
    if style == "on_policy":
        return blp + 1e-6 * torch.randn(B, T, generator=g, dtype=torch.float64), blp
    if style == "far":
        return blp + rng.choice([5.0, 30.0, 200.0]) * torch.randn(B, T, generator=g, dtype=torch.float64), blp
    if style == "extreme":
        big = rng.choice([1e4, 6e4, 1e8, 1e30])
        return -big * torch.rand(B, T, generator=g, dtype=torch.float64), -big * torch.rand(B, T, generator=g, dtype=torch.float64)
    if style == "zero":
        return torch.zeros(B, T, dtype=torch.float64), blp
    return blp + rng.choice([0.01, 0.3, 1.0]) * torch.randn(B, T, generator=g, dtype=torch.float64), blp


def _poison(rng: random.Random, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Garbage at masked positions, which every objective must ignore."""
    if rng.random() < 0.4:
        t = torch.where(mask, t, torch.tensor(rng.choice(NASTY), dtype=t.dtype))
    return t


def _count(rng: random.Random, n: float) -> float | None:
    """None, a valid global count (≥ n), or now and then a wrong one (0, tiny, below n)."""
    if rng.random() < 0.8:
        return rng.choice([None, n, 2 * n + 1])
    return rng.choice([0.0, 1e-30, 1e-3, 1.0, float(max(n - 1, 0))])


def make_case(seed: int):
    """One random call: (objective name, logprobs leaf, args, kwargs)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    name = rng.choice(objectives.names())
    spec = objectives.spec(name)
    dtype = rng.choice(DTYPES)
    B, T = rng.choice([0, 1, 2, 3, 5]), rng.choice([0, 1, 2, 4, 7])
    mask = _mask(rng, B, T)
    lp64, blp64 = _logprobs(rng, g, B, T)
    adv_scale = rng.choice([0.0, 1.0, 1.0, 1e3, 1e6, 1e20, 1e38])
    adv = adv_scale * torch.randn((B, T) if rng.random() < 0.5 else (B,), generator=g, dtype=torch.float64)
    lp = _poison(rng, lp64.to(dtype), mask).detach().requires_grad_(True)
    blp = _poison(rng, blp64.to(dtype), mask)
    if adv.dim() == 2:
        adv = _poison(rng, adv, mask)
    kw: dict = {"aggregation": rng.choice(objectives.AGGREGATIONS)}
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum()) if B else 0.0
    for key, n in (("num_tokens", n_tok), ("num_sequences", n_seq)):
        v = _count(rng, n)
        if v is not None:
            kw[key] = v
    if rng.random() < 0.3:
        kw["seq_constant"] = rng.choice([1e-6, 1.0, 4096.0])
    if rng.random() < 0.2:
        kw["log_ratio_clip"] = rng.choice([1e-3, 5.0, 20.0, 80.0])
    if rng.random() < 0.15:
        kw["check_finite"] = False
    if rng.random() < 0.2:
        kw.update(ref_logprobs=_poison(rng, (lp64 + torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype), mask),
                  ref_kl_coef=rng.choice([0.0, 0.04, 10.0]), ref_kl=rng.choice(list(objectives.KL_ESTIMATORS)))
    if rng.random() < 0.2:
        kw.update(entropy=_poison(rng, torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype) * 5, mask),
                  entropy_coef=rng.choice([0.0, 0.01, 1.0]))
    if spec.needs_proximal:
        kw["proximal_logprobs"] = _poison(rng, (blp64 + rng.choice([0.0, 0.5, 50.0]) *
                                                torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype), mask)
    if "kl" in spec.options:
        kw["kl"] = rng.choice(list(objectives.KL_ESTIMATORS))
    if len(spec.ess_scopes) > 1:
        kw["ess_scope"] = rng.choice(spec.ess_scopes)
    for stat in spec.batch_stats:
        r = rng.random()
        if r < 0.25:
            kw[stat] = RatioStats.from_logprobs(lp64, blp64, mask) + RatioStats.from_logprobs(lp64 * 2, blp64, mask)
        elif r < 0.35:
            kw[stat] = RatioStats(*(torch.tensor(rng.choice([0.0, float("nan"), float("inf"), 3.0]), dtype=torch.float64)
                                    for _ in range(3)))
        elif r < 0.45:
            kw[stat] = rng.choice([0.0, 1e-12, 0.5, 1.0, float("nan")])
        elif r < 0.55 and stat == "ess" and kw.get("ess_scope") == "sequence" and B > 1:
            e = torch.rand(B, generator=g, dtype=torch.float64)
            if rng.random() < 0.5:
                e[rng.randrange(B)] = float("nan")
            kw[stat] = e
    if "correction" in spec.options and rng.random() < 0.5:
        kind = rng.choice(objectives.CORRECTIONS)
        kw.update(correction=kind, old_logprobs=_poison(rng, (blp64 + rng.choice([0.01, 1.0, 30.0]) *
                                                              torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype), mask))
        if rng.random() < 0.3:
            kw["correction_cap"] = rng.choice([1e-6, 1.0, 2.0, 1e6])
        if rng.random() < 0.3:
            kw["correction_band"] = rng.choice([(0.0, 0.0), (0.5, 5.0), (0.0, 1e9)])
        if rng.random() < 0.3 and kind in objectives.corrections.REJECTING:
            kw["correction_count_rejected"] = False
    for key in ("eps_low", "eps_high"):
        if key in spec.options and rng.random() < 0.2:
            kw[key] = rng.choice([0.0, 0.2, 10.0])
    if "dual_clip" in spec.options and rng.random() < 0.2:
        kw["dual_clip"] = 3.0
    if "behavior_weight_cap" in spec.options and rng.random() < 0.3:
        kw["behavior_weight_cap"] = rng.choice([1e-3, 5.0])
    if "importance_weight" in spec.options:
        kw["importance_weight"] = rng.random() < 0.7
    return name, lp, (blp, adv, mask), kw


def run_case(seed: int) -> str:
    """'error' (a ValueError) or 'ok' (finite loss and gradient); fails the test otherwise."""
    name, lp, args, kw = make_case(seed)
    try:
        out = objectives.get(name)(lp, *args, **kw)
        (grad,) = torch.autograd.grad(out.loss, lp, allow_unused=True)  # the backward pass may raise too
    except ValueError:
        return "error"
    assert out.loss.dim() == 0, (seed, name)
    assert math.isfinite(out.loss.item()), (seed, name, out.loss.item())
    assert grad is None or bool(torch.isfinite(grad).all()), (seed, name, grad)
    if kw.get("check_finite", True):  # with the check off, NaN inputs at valid tokens may give NaN metrics
        assert not any(v != v for v in out.metrics.values()), (seed, name, out.metrics)
    return "ok"


def _fuzz(n: int, offset: int = 0) -> dict:
    counts = {"ok": 0, "error": 0}
    for seed in range(offset, offset + n):
        counts[run_case(seed)] += 1
    return counts


def test_fuzz_every_objective_is_finite_or_raises():
    counts = _fuzz(3000)
    # the generator must exercise both outcomes broadly, or the test proves little
    assert counts["ok"] > 1000 and counts["error"] > 100, counts


def test_fuzz_covers_every_objective_dtype_and_correction():
    seen = {"names": set(), "dtypes": set(), "corrections": set()}
    for seed in range(3000):
        name, lp, _, kw = make_case(seed)
        seen["names"].add(name)
        seen["dtypes"].add(lp.dtype)
        seen["corrections"].add(kw.get("correction"))
    assert seen["names"] == set(objectives.names())
    assert seen["dtypes"] == set(DTYPES)
    assert seen["corrections"] >= set(objectives.CORRECTIONS)


@pytest.mark.slow
def test_fuzz_long():
    counts = _fuzz(30_000, offset=10_000)
    assert counts["ok"] > 10_000, counts


# ---- the classes of silent NaN/inf the fuzzer found, one explicit case each ------------------------

P3O = objectives.get("p3o")


def _small(dtype=torch.float32, B=2, T=3):
    lp = torch.full((B, T), -1.0, dtype=dtype).requires_grad_(True)
    return lp, torch.full((B, T), -1.2, dtype=dtype), torch.ones(B, dtype=dtype), torch.ones(B, T, dtype=torch.bool)


def test_num_tokens_zero_with_valid_tokens_raises_and_without_gives_zero():
    lp, blp, adv, m = _small()
    with pytest.raises(ValueError, match="num_tokens=0 is smaller than this call's 6 valid tokens"):
        P3O(lp, blp, adv, m, num_tokens=0.0)
    out = P3O(lp, blp, adv, torch.zeros_like(m), num_tokens=0.0)  # an empty micro-batch of an empty step
    (g,) = torch.autograd.grad(out.loss, lp)
    assert out.loss.item() == 0.0 and torch.all(g == 0)


def test_seq_mean_token_sum_with_no_token_is_zero():
    lp = torch.zeros(3, 0, requires_grad=True)
    e = torch.zeros(3, 0)
    out = objectives.get("grpo")(lp, e, torch.ones(3), torch.zeros(3, 0, dtype=torch.bool), aggregation="seq_mean_token_sum")
    assert out.loss.item() == 0.0


def test_nan_in_a_per_row_ess_raises_unless_the_row_is_empty():
    lp, blp, adv, m = _small()
    with pytest.raises(ValueError, match="ess has 1 rows outside"):
        P3O(lp, blp, adv, m, ess_scope="sequence", ess=torch.tensor([0.5, float("nan")]))
    m[1] = False
    out = P3O(lp, blp, adv, m, ess_scope="sequence", ess=torch.tensor([0.5, float("nan")]))
    assert math.isfinite(out.loss.item())


def test_float16_gradient_overflow_raises_in_backward():
    lp, blp, adv, m = _small(torch.float16)
    # the loss is computed in float32 and is finite (A·log p/N = 1e6/6 per token), but the gradient
    # A/N ≈ 1.67e5 cannot be cast back to float16 (max 65504)
    out = objectives.get("reinforce")(lp, blp, adv.float() * 1e6, m, importance_weight=False)
    assert math.isfinite(out.loss.item())
    with pytest.raises(ValueError, match=r"gradient w.r.t. torch.float16 logprobs reaches 1.67e\+05"):
        torch.autograd.grad(out.loss, lp)


def test_a_deferred_gradient_refusal_is_a_zero_gradient_and_a_message():
    """Inside ``deferred_grad_refusals`` the same overflow lets the backward pass finish (a data-parallel rank must
    reach its collectives): a zero gradient, and the message kept; the block's end restores raising."""
    lp, blp, adv, m = _small(torch.float16)
    with objectives.deferred_grad_refusals() as refused:
        out = objectives.get("reinforce")(lp, blp, adv.float() * 1e6, m, importance_weight=False)
        (g,) = torch.autograd.grad(out.loss, lp)
    assert g.dtype == torch.float16 and not bool(g.any())
    assert len(refused) == 1 and refused[0].startswith("the gradient w.r.t. torch.float16 logprobs reaches 1.67e+05")
    out = objectives.get("reinforce")(lp, blp, adv.float() * 1e6, m, importance_weight=False)
    with pytest.raises(ValueError, match="reaches 1.67e"):
        torch.autograd.grad(out.loss, lp)


def test_huge_advantages_raise_instead_of_inf():
    lp, blp, adv, m = _small()
    with pytest.raises(ValueError, match="the loss is -?inf .*largest \\|advantage\\| 3e\\+38"):
        objectives.get("reinforce")(lp * 10, blp, adv * 3e38, m, importance_weight=False)


def test_ratio_quantiles_above_torch_quantiles_limit(monkeypatch):
    """p50 and p99 of the ratios: NumPy's linear interpolation, for a call with more valid tokens than
    torch.quantile takes (2^24; it raised "input tensor is too large", a bare RuntimeError in the learner)."""
    import numpy as np

    from trustbatch.objectives import _common

    g = torch.Generator().manual_seed(0)
    big = torch.rand(2**24 + 3, generator=g)
    want = np.quantile(big.numpy().astype(np.float64), [0.5, 0.99])
    assert _common.quantiles(big, (0.5, 0.99)).double().numpy() == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(_common, "QUANTILE_MAX_ELEMENTS", 4)  # the sort path on a small call, through an objective
    lp, blp = -torch.rand(3, 5, generator=g) * 2, -torch.rand(3, 5, generator=g) * 2
    out = objectives.get("p3o")(lp.requires_grad_(True), blp, torch.randn(3, generator=g), torch.ones(3, 5, dtype=torch.bool))
    ratio = (lp - blp).exp().detach().flatten().double().numpy()
    want = np.quantile(ratio, [0.5, 0.99])
    assert [float(out.metrics["ratio_p50"]), float(out.metrics["ratio_p99"])] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", ["p3o_two_anchor", "decoupled_ppo"])
def test_a_missing_proximal_snapshot_is_named(name):
    lp, blp, adv, m = _small()
    with pytest.raises(ValueError, match=f"^{name} needs proximal_logprobs \\[B, T\\]"):
        objectives.get(name)(lp, blp, adv, m, proximal_logprobs=None)


def test_per_row_ess_is_refused_outside_sequence_scope():
    lp, blp, adv, m = _small()
    with pytest.raises(ValueError, match="ess has 2 values, but ess_scope='batch' takes one"):
        objectives.get("p3o_two_anchor")(lp, blp, adv, m, proximal_logprobs=blp, ess=torch.tensor([0.5, 0.6]),
                                         ess_proximal=0.9)
    with pytest.raises(ValueError, match="ess has 2 values, but ess_scope='micro_batch' takes one"):
        objectives.get("p3o")(lp, blp, adv, m, ess_scope="micro_batch", ess=torch.tensor([0.5, 0.6]))
