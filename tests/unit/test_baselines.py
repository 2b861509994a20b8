"""Baselines against the per-token weight table of docs/design/objectives.md §3, re-derived independently."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trustbatch import objectives

OBJ = objectives.get


def _batch(seed, B=3, T=5, spread=0.6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.1
    lp = (blp + spread * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).contiguous()
    m = torch.rand(B, T, generator=g) > 0.3
    m[:, 0] = True
    return lp, blp, adv, m


def _grad(name, lp, blp, adv, m, **kw):
    out = OBJ(name)(lp, blp, adv, m, **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out, g


def ppo_weight(r, a, el, eh, c=None):
    """Weight on ∇log π per token (doc §3 table): r·A inside the band, 0 where the clip wins."""
    if (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el):
        return 0.0
    if c is not None and a < 0 and r > c:
        return 0.0
    return r * a


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), el=st.floats(0.05, 0.5), eh=st.floats(0.05, 0.5), dual=st.sampled_from([None, 3.0]))
def test_grpo_weights_and_zero_gradient_regions(seed, el, eh, dual):
    lp, blp, adv, m = _batch(seed, spread=1.0)
    out, g = _grad("grpo", lp, blp, adv, m, eps_low=el, eps_high=eh, dual_clip=dual)
    n = int(m.sum())
    clipped = 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not m[i, t]:
                assert g[i, t] == 0
                continue
            r = math.exp(lp[i, t].item() - blp[i, t].item())
            w = ppo_weight(r, adv[i, t].item(), el, eh, dual)
            clipped += w == 0.0
            assert -g[i, t].item() * n == pytest.approx(w, rel=1e-9, abs=1e-12)
    assert out.metrics["clip_fraction"] == pytest.approx(clipped / n)


def test_grpo_loss_value_by_hand():
    # r = (1.5, 0.5), A = (+1, −1), ε = 0.2: −min(1.5, 1.2) and −min(−0.5, −0.8) → (−1.2, 0.8)
    lp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_(True)
    out = OBJ("grpo")(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert out.metrics["clip_fraction"] == 1.0


def test_dual_clip_bounds_negative_advantage_loss():
    lp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_(True)
    a = torch.tensor([[-1.0, -1.0]])
    out = OBJ("grpo")(lp, torch.zeros(1, 2), a, torch.ones(1, 2, dtype=torch.bool), dual_clip=3.0)
    # r = 5 > c = 3: loss −c·A = 3 (zero gradient); r = 2: loss −r·A = 2
    assert out.loss.item() == pytest.approx((3.0 + 2.0) / 2, abs=1e-6)
    (g,) = torch.autograd.grad(out.loss, lp)
    assert g[0, 0] == 0 and g[0, 1].item() == pytest.approx(2.0 / 2)


def test_dapo_preset_is_clip_higher():
    lp = torch.log(torch.tensor([[1.25, 1.3]])).requires_grad_(True)
    out, g = _grad("dapo", lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    # ε_high = 0.28: r = 1.25 inside (weight r), r = 1.3 clipped (weight 0)
    assert -g[0, 0].item() * 2 == pytest.approx(1.25, rel=1e-6)
    assert g[0, 1].item() == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), eh=st.floats(0.1, 5.0), el=st.sampled_from([None, 0.2]))
def test_cispo_keeps_every_token_with_clipped_weight(seed, eh, el):
    lp, blp, adv, m = _batch(seed, spread=1.2)
    _, g = _grad("cispo", lp, blp, adv, m, eps_high=eh, eps_low=el)
    n = int(m.sum())
    lo = 0.0 if el is None else 1 - el
    r = (lp.detach() - blp).exp()
    w = r.clamp(lo, 1 + eh) * adv
    torch.testing.assert_close(-g * n, torch.where(m, w, 0.0), rtol=1e-9, atol=1e-12)


def test_gspo_sequence_ratio_and_whole_sequence_clip():
    lp, blp, adv, m = _batch(7, spread=0.0004)
    out, g = _grad("gspo", lp, blp, adv, m)
    B = lp.shape[0]
    for i in range(B):
        idx = m[i].nonzero().flatten().tolist()
        L = len(idx)
        s = math.exp(sum((lp[i, t] - blp[i, t]).item() for t in idx) / L)
        a = adv[i, 0].item()
        w = ppo_weight(s, a, 3e-4, 4e-4)
        for t in idx:
            # seq-mean-token-mean: (1/B)(1/L) per token, weight s·A on ∇log π (GSPO-token gradient)
            assert -g[i, t].item() * B * L == pytest.approx(w, rel=1e-8, abs=1e-12)


def test_gspo_equals_sequence_objective_value():
    lp, blp, adv, m = _batch(11, spread=0.3)
    out = OBJ("gspo")(lp, blp, adv, m)
    vals = []
    for i in range(lp.shape[0]):
        idx = m[i].nonzero().flatten().tolist()
        s = math.exp(sum((lp[i, t] - blp[i, t]).item() for t in idx) / len(idx))
        a = adv[i, 0].item()
        vals.append(-min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a))
    assert out.loss.item() == pytest.approx(sum(vals) / len(vals), rel=1e-9)


def test_decoupled_ppo_weights_and_reduction_to_ppo():
    lp, blp, adv, m = _batch(5, spread=0.5)
    g0 = torch.Generator().manual_seed(9)
    prox = blp + 0.3 * torch.randn(blp.shape, generator=g0, dtype=blp.dtype)
    _, g = _grad("decoupled_ppo", lp, blp, adv, m, proximal_logprobs=prox, behavior_weight_cap=1.2)
    lp = lp.detach()  # plain numbers for the computation by hand
    n = int(m.sum())
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if m[i, t]:
                w = min(math.exp(prox[i, t] - blp[i, t]), 1.2)
                r = math.exp(lp[i, t] - prox[i, t])
                assert -g[i, t].item() * n == pytest.approx(w * ppo_weight(r, adv[i, t].item(), 0.2, 0.2), rel=1e-9, abs=1e-12)
    # π_prox = π_b: exactly PPO
    o1 = OBJ("decoupled_ppo")(lp, blp, adv, m, proximal_logprobs=blp)
    o2 = OBJ("grpo")(lp, blp, adv, m)
    assert o1.loss.item() == pytest.approx(o2.loss.item(), rel=1e-12)


def test_reinforce_weight_is_the_ratio():
    lp, blp, adv, m = _batch(3, spread=0.8)
    _, g = _grad("reinforce", lp, blp, adv, m)
    n = int(m.sum())
    torch.testing.assert_close(-g * n, torch.where(m, (lp.detach() - blp).exp() * adv, 0.0))
    _, g1 = _grad("reinforce", lp, blp, adv, m, importance_weight=False)
    torch.testing.assert_close(-g1 * n, torch.where(m, adv, 0.0))


def test_two_anchor_matches_reference_code_formula():
    lp, blp, adv, m = _batch(13, spread=0.5)
    prox = blp + 0.4 * torch.randn(blp.shape, generator=torch.Generator().manual_seed(1), dtype=blp.dtype)
    out, g = _grad("p3o_two_anchor", lp, blp, adv, m, proximal_logprobs=prox)
    lp = lp.detach()  # plain numbers for the computation by hand
    n = int(m.sum())
    sel = m.nonzero().tolist()
    rb = [math.exp(lp[i, t] - blp[i, t]) for i, t in sel]
    rp = [math.exp(lp[i, t] - prox[i, t]) for i, t in sel]
    eb = sum(rb) ** 2 / (n * sum(x * x for x in rb))
    ep = sum(rp) ** 2 / (n * sum(x * x for x in rp))
    emix, wb, wp = min(eb, ep), 1 - eb, 1 - ep
    assert out.metrics["ess"] == pytest.approx(emix, rel=1e-9)
    for (i, t), r in zip(sel, rb):
        log_mix = math.log((wb * math.exp(blp[i, t]) + wp * math.exp(prox[i, t])) / (wb + wp))
        rmix = math.exp(lp[i, t] - log_mix)
        exp_g = (-min(r, emix) * adv[i, t].item() + (1 - emix) * (1 - 1 / rmix)) / n
        assert g[i, t].item() == pytest.approx(exp_g, rel=1e-8, abs=1e-12)


def correction_weight_by_hand(kind, lks, t_index):
    """Weight of token t_index of one sequence with per-token log k = lks (docs/design/objectives.md §3.9), by plain loops."""
    prod = math.exp(sum(lks))
    geo = math.exp(sum(lks) / len(lks))
    k_tok = math.exp(lks[t_index])
    return {
        "tis_token": min(k_tok, 2.0),
        "mis_token": k_tok if 0.5 <= k_tok <= 5.0 else 0.0,  # IcePop keeps the weight k inside the band
        "rej_token": 1.0 if 0.5 <= k_tok <= 5.0 else 0.0,  # rejection: 1 inside, 0 outside
        "tis_sequence_product": min(prod, 2.0),
        "tis_sequence_geomean": min(geo, 2.0),
        "tis_sequence": min(geo, 2.0),  # documented alias of the geometric mean
        "mis_sequence_product": prod if prod <= 2.0 else 0.0,
        "mis_sequence_geomean": geo if geo <= 2.0 else 0.0,
        "mis_sequence": geo if geo <= 2.0 else 0.0,
    }[kind]


# Changed with the IcePop fix: mis_token used to give weight 1 inside the band (now rej_token);
# seq_reduce is now only accepted by the tis_sequence/mis_sequence aliases.
@pytest.mark.parametrize("kind", list(objectives.CORRECTIONS))
def test_corrections_compose_with_grpo(kind):
    lp, blp, adv, m = _batch(17, spread=0.1)
    old = blp + 0.8 * torch.randn(blp.shape, generator=torch.Generator().manual_seed(2), dtype=blp.dtype)
    out, g = _grad("grpo", lp, blp, adv, m, old_logprobs=old, correction=kind)
    lp = lp.detach()  # plain numbers for the computation by hand
    n = int(m.sum())
    for i in range(lp.shape[0]):
        idx = m[i].nonzero().flatten().tolist()
        ks = [old[i, t].item() - blp[i, t].item() for t in idx]
        for j, t in enumerate(idx):
            w = correction_weight_by_hand(kind, ks, j)
            r = math.exp(lp[i, t] - old[i, t])
            assert -g[i, t].item() * n == pytest.approx(w * ppo_weight(r, adv[i, t].item(), 0.2, 0.2), rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("alias, reduce, named", [("tis_sequence", "sum", "tis_sequence_product"),
                                                   ("tis_sequence", "mean", "tis_sequence_geomean"),
                                                   ("mis_sequence", "sum", "mis_sequence_product")])
def test_sequence_alias_with_seq_reduce_equals_named_kind(alias, reduce, named):
    lp, blp, adv, m = _batch(19, spread=0.1)
    old = blp + 0.3 * torch.randn(blp.shape, generator=torch.Generator().manual_seed(4), dtype=blp.dtype)
    _, g1 = _grad("grpo", lp, blp, adv, m, old_logprobs=old, correction=alias, correction_seq_reduce=reduce)
    _, g2 = _grad("grpo", lp, blp, adv, m, old_logprobs=old, correction=named)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    with pytest.raises(ValueError, match="already fixes"):
        _grad("grpo", lp, blp, adv, m, old_logprobs=old, correction=named, correction_seq_reduce="mean" if reduce == "sum" else "sum")


def test_correction_without_old_logprobs_is_an_error():
    lp, blp, adv, m = _batch(1)
    with pytest.raises(ValueError, match="needs old_logprobs"):
        OBJ("grpo")(lp, blp, adv, m, correction="tis_token")


DIFFERENTIABLE = ["grpo", "dapo", "decoupled_ppo"]
STOP_GRADIENT = ["p3o", "p3o_two_anchor", "cispo", "reinforce", "gspo"]


def test_every_objective_is_covered_by_a_gradient_check():
    assert sorted(DIFFERENTIABLE + STOP_GRADIENT) == objectives.names()


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradcheck_float64(name):
    lp, blp, adv, m = _batch(21, B=2, T=4, spread=0.3)
    lp = lp.detach().requires_grad_(True)
    kw = {"proximal_logprobs": blp + 0.1} if objectives.spec(name).needs_proximal else {}
    assert torch.autograd.gradcheck(lambda x: OBJ(name)(x, blp, adv, m, check_finite=False, **kw).loss, (lp,), eps=1e-6, atol=1e-7)


def _k3(x):
    return torch.exp(-x) - 1 + x


def frozen_surrogate(name, x0, blp, adv, m, prox):
    """The loss with every stop-gradient quantity evaluated at x0: its gradient at x0 is the objective's."""
    mf = m.double()
    n = mf.sum()
    r0 = (x0 - blp).exp()
    e0 = (r0 * mf).sum() ** 2 / (n * (r0 * r0 * mf).sum())
    if name == "reinforce":
        return lambda x: (-(r0 * adv * x) * mf).sum() / n
    if name == "cispo":
        return lambda x: (-(r0.clamp(0, 5.0) * adv * x) * mf).sum() / n
    if name == "p3o":
        return lambda x: ((-torch.minimum(r0, e0) * adv * x + (1 - e0) * _k3(x - blp)) * mf).sum() / n
    if name == "p3o_two_anchor":
        rp = (x0 - prox).exp()
        ep = (rp * mf).sum() ** 2 / (n * (rp * rp * mf).sum())
        emix, wb, wp = torch.minimum(e0, ep), 1 - e0, 1 - ep
        log_mix = torch.log((wb * blp.exp() + wp * prox.exp()) / (wb + wp))
        return lambda x: ((-torch.minimum(r0, emix) * adv * x + (1 - emix) * _k3(x - log_mix)) * mf).sum() / n
    if name == "gspo":
        lens = mf.sum(1, keepdim=True)
        s0 = (((x0 - blp) * mf).sum(1, keepdim=True) / lens).exp()

        def f(x):
            s = s0 * torch.exp(x - x0)
            per = -torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv) * mf
            return ((per.sum(1, keepdim=True) / lens).sum()) / lp_rows(m)
        return f
    raise AssertionError(name)


def lp_rows(m):
    return float((m.sum(1) > 0).sum())


@pytest.mark.parametrize("name", STOP_GRADIENT)
def test_stop_gradient_objectives_match_finite_differences_of_their_surrogate(name):
    lp, blp, adv, m = _batch(21, B=2, T=4, spread=0.3)
    x0 = lp.detach()
    prox = blp + 0.1
    kw = {"proximal_logprobs": prox} if objectives.spec(name).needs_proximal else {}
    if name == "gspo":
        kw.update(eps_low=0.2, eps_high=0.2)
    x = x0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(OBJ(name)(x, blp, adv, m, **kw).loss, x)
    f = frozen_surrogate(name, x0, blp, adv, m, prox)
    assert f(x0).item() == pytest.approx(OBJ(name)(x0, blp, adv, m, **kw).loss.item(), rel=1e-10)
    num = torch.zeros_like(x0)
    h = 1e-6
    for i in range(x0.shape[0]):
        for t in range(x0.shape[1]):
            d = torch.zeros_like(x0)
            d[i, t] = h
            num[i, t] = (f(x0 + d) - f(x0 - d)) / (2 * h)
    torch.testing.assert_close(g, num, rtol=1e-6, atol=1e-8)


def test_kl_estimators_values_and_gradients():
    x = torch.tensor([0.7, -1.3, 0.0], dtype=torch.float64, requires_grad=True)
    rho = x.detach().exp()
    for name, val, grad in [
        ("k1", x.detach(), torch.ones(3, dtype=torch.float64)),
        ("k2", 0.5 * x.detach() ** 2, x.detach()),
        ("k3", 1 / rho - 1 + x.detach(), 1 - 1 / rho),
    ]:
        v = objectives.kl_estimate(x, name)
        (g,) = torch.autograd.grad(v.sum(), x)
        torch.testing.assert_close(v.detach(), val)
        torch.testing.assert_close(g, grad)


def test_aggregations_against_loops():
    lp, blp, adv, m = _batch(4, B=3, T=6)
    T = lp.shape[1]
    per = torch.where(m, -(lp.detach() - blp).exp() * adv * lp.detach(), 0.0)
    lens = m.sum(1).tolist()
    tok = per.sum().item() / m.sum().item()
    smtm = sum(per[i].sum().item() / lens[i] for i in range(3)) / 3
    smts = sum(per[i].sum().item() / 10.0 for i in range(3)) / 3
    o = OBJ("reinforce")
    assert o(lp, blp, adv, m).loss.item() == pytest.approx(tok, rel=1e-12)
    assert o(lp, blp, adv, m, aggregation="seq_mean_token_mean").loss.item() == pytest.approx(smtm, rel=1e-12)
    assert o(lp, blp, adv, m, aggregation="seq_mean_token_sum", seq_constant=10.0).loss.item() == pytest.approx(smts, rel=1e-12)
    default_const = sum(per[i].sum().item() / T for i in range(3)) / 3
    assert o(lp, blp, adv, m, aggregation="seq_mean_token_sum").loss.item() == pytest.approx(default_const, rel=1e-12)


def test_reference_kl_and_entropy_terms():
    lp, blp, adv, m = _batch(8)
    ref = blp - 0.2
    ent = torch.rand(lp.shape, dtype=lp.dtype)
    base = OBJ("grpo")(lp, blp, adv, m).loss.item()
    out = OBJ("grpo")(lp, blp, adv, m, ref_logprobs=ref, ref_kl_coef=0.04, entropy=ent, entropy_coef=0.01)
    x = (lp.detach() - ref)
    k3 = (torch.exp(-x) - 1 + x)
    extra = ((0.04 * k3 - 0.01 * ent) * m).sum().item() / m.sum().item()
    assert out.loss.item() == pytest.approx(base + extra, rel=1e-10)


def test_registry():
    assert set(objectives.names()) >= {"p3o", "p3o_two_anchor", "grpo", "dapo", "gspo", "cispo", "decoupled_ppo", "reinforce"}
    with pytest.raises(ValueError, match="unknown objective 'ppo2'"):
        objectives.get("ppo2")
