"""The verl adapter against verl 0.9's own registry, actor config and aggregation (make test-adapters).

The references are independent of the adapter: ``objectives.get(name)`` called directly with the
global counts, P3O's per-token loss written out by hand and aggregated by verl's own
``core_algos.agg_loss``, and float64 autograd throughout.
"""

import os
import subprocess
import sys

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl not installed; run `make test-adapters`")
pytestmark = pytest.mark.adapters

from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from trustbatch import objectives  # noqa: E402
from trustbatch.adapters.verl import register_with_verl  # noqa: E402
from trustbatch.errors import UserError  # noqa: E402

NAMES = ("p3o", "grpo", "cispo")
MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.fixture
def registered():
    """Register under a test prefix; take the entries out again so each test starts clean."""
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    names = register_with_verl(NAMES, options={"grpo": {"eps_high": 0.28}}, prefix="tbtest_")
    yield names
    core_algos.POLICY_LOSS_REGISTRY.clear()
    core_algos.POLICY_LOSS_REGISTRY.update(before)


def _config(bypass=True, **info) -> ActorConfig:
    cfg = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2,
                      policy_loss=PolicyLossConfig(loss_mode="tbtest_p3o",
                                                   rollout_correction=RolloutCorrectionConfig(bypass_mode=bypass)))
    cfg.global_batch_info.update(info)
    return cfg


def _batch(B=4, T=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    lp = (old + 0.6 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-3)
    adv = torch.randn(B, generator=g, dtype=dtype)[:, None].expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.bool)
    for i, n in enumerate(torch.randint(1, T + 1, (B,), generator=g).tolist()):
        mask[i, n:] = False  # right padding, as verl's responses
    return lp, old, adv, mask


def _call(fn, lp, old, adv, mask, mode, cfg):
    """The call verl's actor makes (verl/workers/utils/losses.py, ppo_loss)."""
    return fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=mode, config=cfg,
              rollout_is_weights=None)


def test_verl_returns_the_registered_losses_and_keeps_its_own(registered):
    assert registered == ["tbtest_p3o", "tbtest_grpo", "tbtest_cispo"]
    for n in registered:
        fn = core_algos.get_policy_loss_fn(n)
        assert fn.__name__ == f"trustbatch_{n.removeprefix('tbtest_')}_policy_loss"
    # verl's own cispo is untouched by trustbatch's
    assert core_algos.get_policy_loss_fn("cispo") is core_algos.compute_policy_loss_cispo


def test_registering_twice_or_over_verls_own_names_is_refused(registered):
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    with pytest.raises(UserError, match=r"already holds \['tbtest_p3o'\].*overwrite them silently"):
        register_with_verl(["p3o"], prefix="tbtest_")
    with pytest.raises(UserError, match=r"already holds \['cispo'\]"):
        register_with_verl(["cispo"], prefix="")
    assert core_algos.POLICY_LOSS_REGISTRY == before  # nothing replaced, nothing added
    with pytest.raises(UserError, match="needs a proximal"):
        register_with_verl(["decoupled_ppo"], prefix="tbother_")
    with pytest.raises(UserError, match="loss_agg_mode"):
        register_with_verl(["grpo"], options={"grpo": {"aggregation": "token_mean"}}, prefix="tbother_")
    with pytest.raises(UserError, match="eps_hihg"):
        register_with_verl(["grpo"], options={"grpo": {"eps_hihg": 0.3}}, prefix="tbother_")
    # verl passes its own constant (loss_scale_factor): both gave a bare TypeError in the loss, or one silently won
    with pytest.raises(UserError, match="loss_scale_factor"):
        register_with_verl(["p3o"], options={"p3o": {"seq_constant": 512}}, prefix="tbother_")
    # the reference KL is verl's (kl_loss_type): the option was accepted and never read
    with pytest.raises(UserError, match="kl_loss_type"):
        register_with_verl(["p3o"], options={"p3o": {"ref_kl": "k2"}}, prefix="tbother_")
    assert core_algos.POLICY_LOSS_REGISTRY == before


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_equal_the_objective_with_verls_global_counts(registered, name, mode):
    """Two data-parallel ranks, one micro-batch each: the DDP mean of the ranks' gradients equals the
    objective's gradient over both micro-batches with the global normaliser."""
    fn = core_algos.get_policy_loss_fn("tbtest_" + name)
    opts = {"eps_high": 0.28} if name == "grpo" else {}
    lp, old, adv, mask = _batch()
    halves = (slice(0, 2), slice(2, 4))
    info = dict(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=4, loss_scale_factor=None)
    leaf = lp.clone().requires_grad_(True)
    grads, losses = [], []
    for h in halves:
        x = leaf[h]
        loss, metrics = _call(fn, x, old[h], adv[h], mask[h], mode, _config(**info))
        (g,) = torch.autograd.grad(loss, leaf)
        grads.append(g)
        losses.append(loss.detach())
        assert 0 < metrics["actor/trustbatch/ess"] <= 1
    got_grad = (grads[0] + grads[1]) / 2  # DDP averages gradients over ranks

    ref_leaf = lp.clone().requires_grad_(True)
    agg = {"token-mean": "token_mean", "token-sum": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean"}.get(
        mode, "seq_mean_token_sum")
    ref = 0.0
    for h in halves:  # P3O's ESS is per micro-batch here (micro-batch × rank scope)
        kw = {"aggregation": agg}
        if mode == "token-mean":
            kw["num_tokens"] = info["batch_num_tokens"]
        elif mode == "token-sum":
            kw["num_tokens"] = 1.0 * info["batch_num_tokens"]
        else:
            kw["num_sequences"] = info["global_batch_size"]
            kw["seq_constant"] = 1.0 if mode == "seq-mean-token-sum" else float(mask.shape[1])
        if name == "p3o":
            kw["ess_scope"] = "micro_batch"
        out = objectives.get(name)(ref_leaf[h], old[h], adv[h], mask[h], **kw, **opts)
        ref = ref + out.loss
    if mode == "token-sum":
        ref = ref * info["batch_num_tokens"]  # the sum of the per-token losses
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf)
    torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(sum(losses) / 2, ref.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_p3o_by_hand_aggregated_by_verls_agg_loss(registered, mode):
    """P3O's per-token loss written out (arXiv 2605.12380 Eq. 11–12, k3 KL) and reduced by verl's agg_loss."""
    lp, old, adv, mask = _batch(B=3, T=7, seed=3)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=5 if mode.endswith("norm") else None)
    x = lp.clone().requires_grad_(True)
    loss, metrics = _call(core_algos.get_policy_loss_fn("tbtest_p3o"), x, old, adv, mask, mode, _config(**info))
    (g,) = torch.autograd.grad(loss, x)

    y = lp.clone().requires_grad_(True)
    r = torch.exp(y.detach() - old)[mask]
    e = float(r.sum() ** 2 / (r.numel() * (r * r).sum()))
    lr = y - old
    k3 = torch.exp(-lr) - 1 + lr
    per_token = -torch.minimum(torch.exp(lr.detach()), torch.tensor(e, dtype=lp.dtype)) * adv * y + (1 - e) * k3
    ref = core_algos.agg_loss(per_token, mask, mode, **info)
    (rg,) = torch.autograd.grad(ref, y)
    assert metrics["actor/trustbatch/ess"] == pytest.approx(e, rel=1e-9)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(g, rg, rtol=0, atol=1e-6)


def test_float32_as_verl_passes_it(registered):
    lp, old, adv, mask = (t.float() if t.is_floating_point() else t for t in _batch(seed=5))
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=4, loss_scale_factor=None)
    x = lp.clone().requires_grad_(True)
    loss, _ = _call(core_algos.get_policy_loss_fn("tbtest_grpo"), x, old, adv, mask, "token-mean", _config(**info))
    ref = objectives.get("grpo")(lp.double(), old.double(), adv.double(), mask, eps_high=0.28)
    assert float(loss.detach()) == pytest.approx(float(ref.loss), abs=1e-6)


def test_decoupled_mode_and_missing_counts_are_refused(registered):
    fn = core_algos.get_policy_loss_fn("tbtest_p3o")
    lp, old, adv, mask = _batch()
    with pytest.raises(UserError, match="bypass mode.*bypass_mode=true"):
        _call(fn, lp, old, adv, mask, "token-mean", _config(bypass=False))
    with pytest.raises(UserError, match="rollout_is=null"):
        fn(old, lp, adv, mask, "token-mean", _config(), torch.ones_like(lp))
    with pytest.raises(UserError, match="needs global_batch_info"):
        _call(fn, lp, old, adv, mask, "token-mean", _config(dp_size=2, batch_num_tokens=None))
    with pytest.raises(UserError, match="loss_agg_mode 'token-median'"):
        _call(fn, lp, old, adv, mask, "token-median", _config())


def test_verls_external_module_hook_registers_the_losses_in_a_fresh_process():
    """VERL_USE_EXTERNAL_MODULES is how every verl process (driver, Ray workers) gets the losses."""
    code = ("import verl\nfrom verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "print(get_policy_loss_fn('trustbatch_p3o').__name__)")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "trustbatch.adapters.verl_plugin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "trustbatch_p3o_policy_loss"
