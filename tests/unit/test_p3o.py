"""P3O against hand-worked values (docs/design/objectives.md §1.6) and an independent float64 re-derivation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trustbatch import objectives
from trustbatch.objectives import RatioStats

P3O = objectives.get("p3o")


def ess_by_hand(r):
    s1 = sum(r)
    s2 = sum(x * x for x in r)
    return s1 * s1 / (len(r) * s2)


@pytest.mark.parametrize("ratios, expected", [
    ((4, 1, 1, 1), 49 / 76),
    ((8, 2, 2, 2), 49 / 76),
    ((3, 1, 1, 1), 0.75),
    ((1.1, 1.0, 0.9, 1.0), 16 / 16.08),
    ((0.5, 0.5, 0.5, 0.5), 1.0),
    ((1, 0, 0, 0), 0.25),
    ((0.25, 1, 1, 1), 0.862245),
])
def test_ess_document_values(ratios, expected):
    r = torch.tensor([ratios], dtype=torch.float64)
    e, fb = RatioStats.from_ratio(r, torch.ones_like(r, dtype=torch.bool)).ess()
    assert not fb
    assert e == pytest.approx(expected, abs=1e-6)


def _doc_batch():
    rho = torch.tensor([[4.0, 1.0, 1.0, 1.0]])
    blp = torch.log(torch.tensor([[0.1, 0.5, 0.5, 0.5]]))
    lp = (blp + rho.log()).clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    return lp, blp, adv, torch.ones(1, 4, dtype=torch.bool)


def test_document_loss_weights_and_gradient():
    lp, blp, adv, m = _doc_batch()
    out = P3O(lp, blp, adv, m)
    out.loss.backward()
    e = 49 / 76
    assert out.metrics["ess"] == pytest.approx(e, abs=1e-6)
    assert out.metrics["kl_weight"] == pytest.approx(1 - e, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.092480, abs=2e-6)
    g = lp.grad[0] * 4  # undo 1/N
    # ρ = 4, A = +1: −e + (1 − e)(1 − 1/4) = −0.378289 (the document's worked value)
    assert g[0].item() == pytest.approx(-0.378289, abs=2e-6)
    assert g[1].item() == pytest.approx(-0.644737, abs=2e-6)
    assert g[2].item() == pytest.approx(0.644737, abs=2e-6)
    assert out.metrics["cap_fraction"] == 1.0  # every ρ ≥ e, including ρ = 1


def test_cap_is_one_sided_and_absolute():
    # one batch with e_B = 49/76: ρ = 1.5 is capped to e, ρ = 0.3 passes unchanged (doc §1.6)
    lp, blp, adv, m = _doc_batch()
    e = 49 / 76
    extra_lp = torch.log(torch.tensor([[1.5, 0.3]])).requires_grad_(True)
    out = P3O(extra_lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), ess=e, kl="k1")
    out.loss.backward()
    # k1 gradient is 1 per token: ∂ℓ/∂logp = −w·A + (1 − e)
    w = -(extra_lp.grad[0] * 2 - (1 - e))
    assert w[0].item() == pytest.approx(e, abs=1e-6)
    assert w[1].item() == pytest.approx(0.3, abs=1e-6)


def test_on_policy_is_reinforce_with_zero_kl():
    torch.manual_seed(1)
    B, T = 5, 7
    blp = -torch.rand(B, T) * 3
    adv = torch.randn(B, 1).expand(B, T)
    m = torch.rand(B, T) > 0.3
    lp = blp.clone().requires_grad_(True)
    out = P3O(lp, blp, adv, m)
    out.loss.backward()
    assert out.metrics["ess"] == 1.0
    assert out.metrics["kl_behavior"] == 0.0
    assert out.metrics["kl_loss"] == 0.0
    n = m.sum()
    expected = torch.where(m, -adv / n, 0.0)  # REINFORCE: ∂/∂logp of −(1/N) Σ A·logp
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-7)


def test_ess_is_scale_free():
    torch.manual_seed(2)
    lr = torch.randn(3, 9) * 0.5
    m = torch.ones(3, 9, dtype=torch.bool)
    e1, _ = RatioStats.from_logprobs(lr, torch.zeros_like(lr), m).ess()
    e2, _ = RatioStats.from_logprobs(lr + math.log(7.3), torch.zeros_like(lr), m).ess()
    assert e1 == pytest.approx(e2, rel=1e-6)  # log ρ is computed in float32 by contract
    assert e1 < 1.0


def test_padding_with_inf_and_nan_changes_nothing():
    torch.manual_seed(3)
    B, T = 4, 6
    lp0 = -torch.rand(B, T) * 2
    blp = lp0 + 0.3 * torch.randn(B, T)
    adv = torch.randn(B, T)
    m = torch.ones(B, T, dtype=torch.bool)
    lp = lp0.clone().requires_grad_(True)
    ref = P3O(lp, blp, adv, m)
    ref.loss.backward()
    # the same batch with 3 extra padded columns full of garbage
    pad = torch.tensor([float("nan"), float("inf"), -float("inf")]).expand(B, 3)
    lp2 = torch.cat([lp0, pad], 1).requires_grad_(True)
    out = P3O(lp2, torch.cat([blp, -pad], 1), torch.cat([adv, pad], 1), torch.cat([m, torch.zeros(B, 3, dtype=torch.bool)], 1))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-7)
    torch.testing.assert_close(lp2.grad[:, :T], lp.grad, rtol=0, atol=1e-7)
    assert torch.all(lp2.grad[:, T:] == 0)
    for k in ("ess", "cap_fraction", "kl_behavior", "ratio_max"):
        assert out.metrics[k] == pytest.approx(ref.metrics[k], abs=1e-7)


def independent_p3o_grad(lp, blp, adv, m, kl):
    """∂L/∂logp from the closed form (doc §1.2, §1.3, §5), float64, with plain loops."""
    B, T = lp.shape
    ratios = [math.exp(lp[i, t] - blp[i, t]) for i in range(B) for t in range(T) if m[i, t]]
    n = len(ratios)
    e = ess_by_hand(ratios)
    g = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if not m[i, t]:
                continue
            r = math.exp(lp[i, t] - blp[i, t])
            dkl = {"k3": 1 - 1 / r, "k2": math.log(r), "k1": 1.0}[kl]
            g[i, t] = (-min(r, e) * adv[i, t] + (1 - e) * dkl) / n
    return g, e


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 4), T=st.integers(1, 6), seed=st.integers(0, 10_000),
    kl=st.sampled_from(["k1", "k2", "k3"]), spread=st.floats(0.0, 2.0),
)
def test_gradient_matches_closed_form(B, T, seed, kl, spread):
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = (blp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) > 0.4
    m[0, 0] = True
    out = P3O(lp, blp, adv, m, kl=kl)
    out.loss.backward()
    exp_g, e = independent_p3o_grad(lp.detach(), blp, adv, m, kl)
    assert out.metrics["ess"] == pytest.approx(e, rel=1e-9)
    torch.testing.assert_close(lp.grad, exp_g, rtol=1e-9, atol=1e-12)


def test_sequence_scope_uses_one_ess_per_row():
    lp = torch.log(torch.tensor([[4.0, 1.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0]], dtype=torch.float64)).requires_grad_(True)
    blp = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.ones(2, 4, dtype=torch.float64)
    m = torch.ones(2, 4, dtype=torch.bool)
    out = P3O(lp, blp, adv, m, ess_scope="sequence", kl="k1")
    out.loss.backward()
    e = [ess_by_hand([4, 1, 1, 1]), ess_by_hand([2, 2, 1, 1])]
    for i in range(2):
        # k1 gradient 1: ∂ℓ/∂logp = (−min(ρ, e_i) + (1 − e_i)) / N
        rho = lp.detach()[i].exp()
        exp = (-torch.minimum(rho, torch.tensor(e[i], dtype=torch.float64)) + (1 - e[i])) / 8
        torch.testing.assert_close(lp.grad[i], exp)
    assert out.metrics["ess"] == pytest.approx(sum(e) / 2)


def test_nonfinite_statistics_fall_back_to_one_and_count():
    st_ = RatioStats(torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64),
                     torch.tensor(3.0, dtype=torch.float64))
    assert st_.ess() == (1.0, True)
    lp, blp, adv, m = _doc_batch()
    out = P3O(lp, blp, adv, m, ess=st_)
    assert out.metrics["ess_fallback"] == 1.0
    assert out.metrics["kl_weight"] == 0.0


def test_log_ratio_clamp_is_counted_and_keeps_sums_finite():
    lp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    blp = torch.tensor([[-200.0, -1.0]])  # log ρ = 200: beyond the ±20 bound
    out = P3O(lp, blp, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    out.loss.backward()
    assert out.metrics["log_ratio_clamped"] == 0.5
    assert math.isfinite(out.loss.item())
    assert torch.isfinite(lp.grad).all()
    r = math.exp(20.0)
    assert out.metrics["ess"] == pytest.approx((r + 1) ** 2 / (2 * (r * r + 1)), rel=1e-6)


def test_bad_input_errors_name_the_tensor():
    lp, blp, adv, m = _doc_batch()
    with pytest.raises(ValueError, match="behavior_logprobs"):
        P3O(lp, blp[:, :3], adv, m)
    with pytest.raises(ValueError, match="advantages"):
        P3O(lp, blp, adv[:, :2], m)
    bad = blp.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="behavior_logprobs has 1 non-finite"):
        P3O(lp, bad, adv, m)
    with pytest.raises(ValueError, match="mask must be bool"):
        P3O(lp, blp, adv, torch.full((1, 4), 2))
    with pytest.raises(ValueError, match="unknown option 'epsilon'"):
        P3O(lp, blp, adv, m, epsilon=0.2)
    with pytest.raises(ValueError, match=r"ess=1.5 is outside \[0, 1\]"):
        P3O(lp, blp, adv, m, ess=1.5)


def test_all_false_mask_gives_zero_loss_with_gradient_path():
    lp, blp, adv, _ = _doc_batch()
    out = P3O(lp, blp, adv, torch.zeros(1, 4, dtype=torch.bool))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.all(lp.grad == 0)
    assert out.metrics["ess"] == 1.0
