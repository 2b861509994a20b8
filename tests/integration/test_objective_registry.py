"""The registry's declarations and option checks, the corrections against independent loops, cap_fraction."""

import math
import subprocess
import sys

import pytest
import torch

from trustbatch import objectives
from trustbatch.objectives import correction_weights, registry

# ---- declarations -------------------------------------------------------------------------------


def test_declarations():
    p3o = objectives.spec("p3o")
    assert p3o.batch_stats == ("ess",) and not p3o.needs_proximal
    assert p3o.ess_scopes == ("batch", "micro_batch", "sequence")
    two = objectives.spec("p3o_two_anchor")
    assert two.needs_proximal and two.batch_stats == ("ess", "ess_proximal") and two.ess_scopes == ("batch",)
    dec = objectives.spec("decoupled_ppo")
    assert dec.needs_proximal and dec.batch_stats == ()
    for name in ("grpo", "dapo", "gspo", "cispo", "reinforce"):
        s = objectives.spec(name)
        assert (s.needs_proximal, s.batch_stats, s.ess_scopes) == (False, (), ("batch",))
        assert s.fn is objectives.get(name)
    # the spec is the only declaration: no name sets beside it
    assert not hasattr(objectives, "USES_BATCH_ESS") and not hasattr(objectives, "NEEDS_PROXIMAL")


def test_an_objective_sets_its_own_default_of_a_common_option_as_a_keyword_default():
    """gspo's sequence-mean aggregation (its paper's) is in its spec, where the adapters read it, not in code."""
    from trustbatch.adapters._common import default_aggregation

    assert objectives.spec("gspo").default("aggregation") == "seq_mean_token_mean" == default_aggregation("gspo")
    assert {default_aggregation(n) for n in objectives.names() if n != "gspo"} == {"token_mean"}
    with pytest.raises(ValueError, match="the default is 'seq_mean_token_mean'"):
        objectives.validate_options("gspo", {"aggregation": "sum"})
    # the default is what runs: rows of 1 and 3 tokens, where the two means differ (hand-worked below)
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss = objectives.get("gspo")(lp, torch.zeros(2, 3), adv, mask).loss
    # on-policy, every token's clipped surrogate is -A: row means -1 and +1, their mean 0 (the token mean is 0.5)
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    token_mean = objectives.get("gspo")(lp, torch.zeros(2, 3), adv, mask, aggregation="token_mean").loss
    assert token_mean.item() == pytest.approx(0.5, abs=1e-7)


def test_spec_of_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown objective 'ppo2'; choose one of \['cispo'"):
        objectives.spec("ppo2")


def _toy(logprobs, behavior_logprobs, advantages, mask, *, scale: float = 1.0, **options):
    return objectives.get("reinforce")(logprobs * scale, behavior_logprobs, advantages, mask, **options)


def test_register_as_decorator_and_its_refusals():
    try:
        got = objectives.register("toy_x", options={"scale": registry.number(gt=0)})(_toy)
        assert got is _toy and objectives.spec("toy_x").fn is _toy
        assert objectives.validate_options("toy_x", {"scale": 2}) == {"scale": 2}
        with pytest.raises(ValueError, match="already registered"):
            objectives.register("toy_x", _toy, options={"scale": registry.number(gt=0)})
    finally:
        registry._REGISTRY.pop("toy_x", None)
    with pytest.raises(ValueError, match="keyword 'scale' has no option check"):
        objectives.register("toy_y", _toy)
    with pytest.raises(ValueError, match="no proximal_logprobs keyword"):
        objectives.register("toy_y", _toy, needs_proximal=True, options={"scale": registry.NONNEG})
    with pytest.raises(ValueError, match="need an ess_scope keyword"):
        objectives.register("toy_y", _toy, ess_scopes=("batch", "sequence"), options={"scale": registry.NONNEG})
    with pytest.raises(ValueError, match="batch_stats"):
        objectives.register("toy_y", _toy, batch_stats=("kl",), options={"scale": registry.NONNEG})
    assert "toy_y" not in objectives.names()


# ---- validate_options ---------------------------------------------------------------------------

GOOD = {
    "p3o": {"kl": "k2", "aggregation": "seq_mean_token_mean", "log_ratio_clip": 10, "check_finite": False},
    "p3o_two_anchor": {"kl": "k1", "seq_constant": 4096},
    "grpo": {"eps_low": 0.2, "eps_high": 1, "dual_clip": 3.0},
    "dapo": {"eps_high": 0.28, "dual_clip": None},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
    "cispo": {"eps_low": None, "eps_high": 4},
    "decoupled_ppo": {"behavior_weight_cap": 5, "eps_low": 0.0},
    "reinforce": {"importance_weight": False, "ref_kl": "k3", "ref_kl_coef": 0.0, "entropy_coef": 0},
}


def test_good_options_are_accepted_for_every_objective():
    assert sorted(GOOD) == objectives.names()
    for name, opts in GOOD.items():
        assert objectives.validate_options(name, opts) == opts
        assert objectives.validate_options(name, {}) == {}


def test_correction_options_need_old_logprobs_supplied():
    opts = {"correction": "mis_token", "correction_band": [0.5, 5], "correction_count_rejected": False}
    assert objectives.validate_options("grpo", opts, supplied={"old_logprobs"})["correction_band"] == (0.5, 5)
    with pytest.raises(ValueError, match="needs the old_logprobs tensor, which this caller does not supply"):
        objectives.validate_options("grpo", opts)


def _one_line_error(name, opts, *parts, **kw):
    with pytest.raises(ValueError) as e:
        objectives.validate_options(name, opts, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"'{name}'" in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


@pytest.mark.parametrize("name, opts, parts", [
    ("grpo", {"epsilon": 0.2}, ["unknown option 'epsilon'", "eps_high"]),
    ("grpo", {"eps_hihg": 0.2}, ["did you mean 'eps_high'"]),
    ("p3o", {"eps_low": 0.2}, ["unknown option 'eps_low'"]),
    ("decoupled_ppo", {"correction": "tis_token"}, ["unknown option 'correction'"]),
    ("grpo", {"eps_high": "3e-1"}, ["eps_high must be a number, got the string '3e-1'", "0.3"]),
    ("grpo", {"eps_low": True}, ["eps_low must be a number, got the bool True"]),
    ("cispo", {"eps_high": [1.0]}, ["eps_high must be a number"]),
    ("grpo", {"eps_low": -0.1}, ["eps_low must be a finite number ≥ 0", "-0.1", "the default is 0.2"]),
    ("grpo", {"eps_high": float("nan")}, ["eps_high must be a finite number"]),
    ("gspo", {"eps_high": float("inf")}, ["eps_high must be a finite number"]),
    ("grpo", {"dual_clip": 1.0}, ["dual_clip must be a finite number > 1"]),
    ("decoupled_ppo", {"behavior_weight_cap": 0}, ["behavior_weight_cap must be a finite number > 0"]),
    ("p3o", {"log_ratio_clip": 0}, ["log_ratio_clip must be a finite number > 0 and ≤ 80"]),
    ("p3o", {"log_ratio_clip": 200}, ["log_ratio_clip", "≤ 80"]),
    ("p3o", {"seq_constant": 0}, ["seq_constant must be a finite number > 0 or None"]),
    ("reinforce", {"ref_kl_coef": -1.0}, ["ref_kl_coef must be a finite number ≥ 0"]),
    ("reinforce", {"entropy_coef": "0.01"}, ["entropy_coef must be a number, got the string '0.01'"]),
    ("p3o", {"kl": "k4"}, ["kl must be one of 'k1', 'k2', 'k3', 'exact', got the string 'k4'"]),
    ("p3o", {"aggregation": "sum"}, ["aggregation must be one of 'token_mean'"]),
    ("reinforce", {"importance_weight": 1}, ["importance_weight must be true or false, got int 1"]),
    ("reinforce", {"check_finite": "yes"}, ["check_finite must be true or false"]),
    ("grpo", {"correction": "icepop"}, ["correction must be one of 'tis_token'"]),
    ("grpo", {"correction_band": (5, 0.5)}, ["correction_band must be a pair", "[5, 0.5]"]),
    ("grpo", {"correction_band": 0.5}, ["correction_band must be a pair"]),
    ("grpo", {"correction_band": ["0.5", 5]}, ["correction_band[0] must be a number, got the string '0.5'"]),
    ("grpo", {"correction_cap": 0.0}, ["correction_cap must be a finite number > 0"]),
    ("grpo", {"correction_seq_reduce": "prod"}, ["correction_seq_reduce must be one of 'mean', 'sum'"]),
    ("grpo", {"correction_cap": 2.0}, ["'correction_cap' has no effect without a correction"]),
    ("p3o", {"ess_scope": "sequence"}, ["'ess_scope' is supplied by the trainer", "train.ess_scope"]),
    ("p3o", {"num_tokens": 10}, ["'num_tokens' is supplied by the trainer"]),
    ("p3o", {"num_sequences": 10}, ["'num_sequences' is supplied by the trainer"]),
    ("p3o", {"ess": 0.5}, ["'ess' is supplied by the trainer"]),
    ("p3o_two_anchor", {"ess_proximal": 0.5}, ["'ess_proximal' is supplied by the trainer"]),
    ("decoupled_ppo", {"proximal_logprobs": None}, ["'proximal_logprobs' is supplied by the trainer"]),
    ("grpo", {"old_logprobs": None}, ["'old_logprobs' is a [B, T] tensor"]),
    ("p3o", {"ref_logprobs": None}, ["'ref_logprobs' is a [B, T] tensor"]),
    ("p3o", {"entropy_coef": 0.01}, ["'entropy_coef'=0.01 needs the entropy tensor"]),
    ("grpo", {"ref_kl_coef": 0.04}, ["'ref_kl_coef'=0.04 needs the ref_logprobs tensor"]),
])
def test_bad_options_fail_with_one_line_naming_the_option(name, opts, parts):
    _one_line_error(name, opts, *parts)


def test_options_must_be_a_mapping():
    _one_line_error("p3o", [("kl", "k1")], "options must be a mapping")


def test_every_keyword_of_every_objective_is_declared():
    import inspect

    for name in objectives.names():
        s = objectives.spec(name)
        for p in inspect.signature(s.fn).parameters.values():
            if p.kind == p.KEYWORD_ONLY:
                assert p.name in s.options or p.name in objectives.TRAINER_SUPPLIED, (name, p.name)


def test_importing_objectives_loads_no_heavy_module():
    code = ("import sys, trustbatch.objectives; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'pydantic', 'ray', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- corrections against independent loops ------------------------------------------------------


def _corr_data(seed=0, B=4, T=6, spread=1.2):
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = blp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) > 0.25
    m[:, 0] = True
    return torch.where(m, old, 0.0), torch.where(m, blp, 0.0), m


def _by_loop(old, blp, m, rule):
    """Per-token weights from plain Python loops; ``rule(ks, j)`` gives token j's weight from its row's log k."""
    B, T = m.shape
    w = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        idx = [t for t in range(T) if m[i, t]]
        ks = [old[i, t].item() - blp[i, t].item() for t in idx]
        for j, t in enumerate(idx):
            w[i, t] = rule(ks, j)
    return w


def test_mis_token_is_icepop_weight_k_inside_the_band():
    old, blp, m = _corr_data(1)
    lo, hi = 0.5, 2.0

    def icepop(ks, j):
        k = math.exp(ks[j])
        return k if lo <= k <= hi else 0.0

    w, kept, _ = correction_weights(old, blp, m, "mis_token", band=(lo, hi))
    exp = _by_loop(old, blp, m, icepop)
    torch.testing.assert_close(w, exp, rtol=1e-12, atol=0)
    assert bool(((exp > 0) & (exp != 1)).any()) and bool(((exp == 0) & m).any())  # both regions exercised
    assert torch.equal(kept, (exp > 0) & m)


def test_rej_token_is_one_inside_the_band():
    old, blp, m = _corr_data(2)
    w, kept, metrics = correction_weights(old, blp, m, "rej_token", band=(0.5, 2.0))
    exp = _by_loop(old, blp, m, lambda ks, j: 1.0 if 0.5 <= math.exp(ks[j]) <= 2.0 else 0.0)
    torch.testing.assert_close(w, exp, rtol=0, atol=0)
    assert metrics["correction_zeroed"].item() == pytest.approx(((exp == 0) & m).sum().item() / m.sum().item())


@pytest.mark.parametrize("kind, rule", [
    ("tis_sequence_product", lambda ks, j: min(math.exp(sum(ks)), 2.0)),
    ("tis_sequence_geomean", lambda ks, j: min(math.exp(sum(ks) / len(ks)), 2.0)),
    ("tis_sequence", lambda ks, j: min(math.exp(sum(ks) / len(ks)), 2.0)),
    ("mis_sequence_product", lambda ks, j: math.exp(sum(ks)) if math.exp(sum(ks)) <= 2.0 else 0.0),
])
def test_sequence_corrections_product_and_geometric_mean(kind, rule):
    old, blp, m = _corr_data(3, spread=0.4)
    w, _, _ = correction_weights(old, blp, m, kind)
    torch.testing.assert_close(w, _by_loop(old, blp, m, rule), rtol=1e-12, atol=0)


def test_product_and_geomean_differ_on_this_data():
    old, blp, m = _corr_data(3, spread=0.4)
    a, _, _ = correction_weights(old, blp, m, "tis_sequence_product")
    b, _, _ = correction_weights(old, blp, m, "tis_sequence_geomean")
    assert (a - b).abs().max() > 0.05


def test_rejected_tokens_leave_the_denominator_when_asked():
    old, blp, m = _corr_data(4)
    lp = (blp + 0.1).clone().requires_grad_(True)
    adv = torch.linspace(-1, 1, m.shape[0], dtype=torch.float64)
    kw = dict(old_logprobs=old, correction="rej_token", correction_band=(0.5, 2.0), importance_weight=False)
    keep = _by_loop(old, blp, m, lambda ks, j: 1.0 if 0.5 <= math.exp(ks[j]) <= 2.0 else 0.0).bool()
    # importance_weight=False: ℓ_t = −w_t·A·log π_θ with w ∈ {0, 1}
    kept_sum = sum(-adv[i].item() * lp[i, t].item() for i in range(m.shape[0]) for t in range(m.shape[1]) if keep[i, t])
    out_all = objectives.get("reinforce")(lp, blp, adv, m, **kw)
    out_kept = objectives.get("reinforce")(lp, blp, adv, m, correction_count_rejected=False, **kw)
    assert out_all.loss.item() == pytest.approx(kept_sum / m.sum().item(), rel=1e-12)
    assert out_kept.loss.item() == pytest.approx(kept_sum / keep.sum().item(), rel=1e-12)
    assert keep.sum() < m.sum()
    with pytest.raises(ValueError, match="rejects no token"):
        objectives.get("reinforce")(lp, blp, adv, m, old_logprobs=old, correction="tis_token",
                                    correction_count_rejected=False)


# ---- cap_fraction ---------------------------------------------------------------------------------


def test_cap_fraction_is_zero_on_policy_with_float32_noise():
    g = torch.Generator().manual_seed(5)
    blp = -torch.rand(8, 32, generator=g) * 5
    lp = (blp + 1e-6 * torch.randn(8, 32, generator=g)).requires_grad_(True)
    adv = torch.randn(8, generator=g)
    m = torch.ones(8, 32, dtype=torch.bool)
    out = objectives.get("p3o")(lp, blp, adv, m)
    rho = (lp.detach() - blp).exp()
    assert out.metrics["ess"] < 1.0
    assert bool((rho > out.metrics["ess"]).any())  # the noise alone crosses e: the old count was > 0
    assert out.metrics["cap_fraction"] == 0.0


def test_cap_fraction_hand_count():
    rho = torch.tensor([[1.0, 0.9, 0.90005, 0.95, 2.0, 0.5]], dtype=torch.float64)
    # e = 0.9: capped 1.0, 0.95, 2.0; not 0.9 (equal), 0.90005 (within 1e-4 of e), 0.5
    out = objectives.get("p3o")(rho.log().requires_grad_(True), torch.zeros(1, 6, dtype=torch.float64),
                                torch.ones(1, 6, dtype=torch.float64), torch.ones(1, 6, dtype=torch.bool), ess=0.9)
    assert out.metrics["cap_fraction"] == pytest.approx(3 / 6)


def test_cap_weight_removed_hand_worked():
    # e = 0.9; ρ = [1.0, 0.5, 2.0, 3.0], |A| = [1, 2, 0.5, 0] (the last token has no advantage: it weighs nothing)
    # removed: 1·(1.0 − 0.9) + 2·0 + 0.5·(2.0 − 0.9) + 0 = 0.1 + 0.55 = 0.65
    # total:   1·1.0 + 2·0.5 + 0.5·2.0 + 0 = 3.0
    rho = torch.tensor([[1.0, 0.5, 2.0, 3.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64)
    m = torch.ones(1, 4, dtype=torch.bool)
    p3o = objectives.get("p3o")
    out = p3o(rho.log().requires_grad_(True), torch.zeros(1, 4, dtype=torch.float64), adv, m, ess=0.9)
    assert float(out.metrics["cap_weight_removed"]) == pytest.approx(0.65 / 3.0, rel=1e-12)
    # a masked token counts for nothing, and all-zero advantages give 0, not NaN
    m2 = torch.tensor([[True, True, False, True]])
    out = p3o(rho.log().requires_grad_(True), torch.zeros(1, 4, dtype=torch.float64), adv, m2, ess=0.9)
    assert float(out.metrics["cap_weight_removed"]) == pytest.approx(0.1 / 2.0, rel=1e-12)
    out = p3o(rho.log().requires_grad_(True), torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.float64), m, ess=0.9)
    assert float(out.metrics["cap_weight_removed"]) == 0.0


def test_cap_weight_removed_stays_finite_where_float32_sums_overflow():
    # log ρ = 80 on 100 tokens with |A| = 1e3: Σ|A|·ρ ≈ 5.5e39 is beyond float32's 3.4e38
    lp = torch.full((1, 100), 80.0).requires_grad_(True)
    out = objectives.get("p3o")(lp, torch.zeros(1, 100), torch.full((1, 100), 1e3), torch.ones(1, 100, dtype=torch.bool),
                                ess=0.5, log_ratio_clip=80.0)
    # every token is capped at e = 0.5: removed share (ρ − 0.5)/ρ, 1 − 0.5·e^−80 in float64
    assert float(out.metrics["cap_weight_removed"]) == pytest.approx(1.0, abs=1e-12)
