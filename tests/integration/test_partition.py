"""Batch-scope ESS: loss and gradient are invariant to micro-batch and data-parallel partitioning."""

import pytest
import torch
import torch.distributed as dist

from trustbatch import objectives
from trustbatch.objectives import RatioStats

from gloo_ranks import two_gloo_ranks

P3O = objectives.get("p3o")


def _data(B=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(B, T, generator=g) * 2
    lp = blp + 0.7 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    m = torch.rand(B, T, generator=g) > 0.3
    m[:, 0] = True
    return lp, blp, adv, m


def _full(lp, blp, adv, m):
    x = lp.clone().requires_grad_(True)
    out = P3O(x, blp, adv, m)
    out.loss.backward()
    return out.loss.item(), x.grad


def _split(lp, blp, adv, m, parts):
    stats = RatioStats.zeros()
    for p in parts:
        stats = stats + RatioStats.from_logprobs(lp[p], blp[p], m[p])
    n = float(m.sum())
    total, grads = 0.0, torch.zeros_like(lp)
    for p in parts:
        x = lp[p].clone().requires_grad_(True)
        out = P3O(x, blp[p], adv[p], m[p], ess=stats, num_tokens=n)
        out.loss.backward()
        total += out.loss.item()
        grads[p] = x.grad
    return total, grads


@pytest.mark.parametrize("parts", [
    [slice(0, 1), slice(1, 6)],
    [slice(0, 3), slice(3, 6)],
    [slice(i, i + 1) for i in range(6)],
    [torch.tensor([0, 4]), torch.tensor([1, 2, 5]), torch.tensor([3])],
])
def test_micro_batch_split_equals_single_batch(parts):
    lp, blp, adv, m = _data()
    ref_loss, ref_grad = _full(lp, blp, adv, m)
    loss, grad = _split(lp, blp, adv, m, parts)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)


def test_micro_batch_scope_differs_from_batch_scope():
    # the reference code's scope: each micro-batch has its own ESS, so the result depends on the split
    lp, blp, adv, m = _data()
    ref_loss, _ = _full(lp, blp, adv, m)
    n = float(m.sum())
    loss = sum(P3O(lp[p], blp[p], adv[p], m[p], ess_scope="micro_batch", num_tokens=n).loss.item()
               for p in [slice(0, 3), slice(3, 6)])
    assert abs(loss - ref_loss) > 1e-4


def _rank_part(world, out_dir):
    lp, blp, adv, m = _data()
    rows = torch.arange(6)[world.rank::world.size]  # uneven token counts per rank
    stats = RatioStats.from_logprobs(lp[rows], blp[rows], m[rows]).all_reduce()
    n = torch.tensor([float(m[rows].sum())], dtype=torch.float64)
    dist.all_reduce(n)
    x = lp[rows].clone().requires_grad_(True)
    out = P3O(x, blp[rows], adv[rows], m[rows], ess=stats, num_tokens=float(n))
    out.loss.backward()
    loss = torch.tensor([out.loss.item()], dtype=torch.float64)
    dist.all_reduce(loss)
    return rows, float(loss), x.grad, float(out.metrics["ess"])


def test_two_gloo_processes_equal_single_batch(tmp_path):
    lp, blp, adv, m = _data()
    ref_loss, ref_grad = _full(lp, blp, adv, m)
    results = two_gloo_ranks(_rank_part, tmp_path)
    grad = torch.zeros_like(lp)
    e_ref = RatioStats.from_logprobs(lp, blp, m).ess()[0]
    for rows, loss, g, e in results:
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        assert e == pytest.approx(e_ref, abs=1e-7)
        grad[rows] = g
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)


def _two_anchor_data():
    lp, blp, adv, m = _data(B=6, T=5, seed=3)
    prox = blp + 0.5 * torch.randn(blp.shape, generator=torch.Generator().manual_seed(7))
    return lp.double(), blp.double(), adv.double(), m, prox.double()


def _two_anchor_stats(lp, blp, prox, m, rows):
    # float64 inputs: RatioStats casts to float32 for log ρ, as the learner's no-grad pass does
    return (RatioStats.from_logprobs(lp[rows], blp[rows], m[rows]),
            RatioStats.from_logprobs(lp[rows], prox[rows], m[rows]))


@pytest.mark.parametrize("size", [2, 3, 6])
def test_two_anchor_micro_batches_with_batch_stats_equal_single_batch(size):
    """Batch-wide ess and ess_proximal RatioStats plus the global num_tokens make the split exact."""
    lp, blp, adv, m, prox = _two_anchor_data()
    fn = objectives.get("p3o_two_anchor")
    ess_b, ess_p = _two_anchor_stats(lp, blp, prox, m, slice(0, 6))
    x = lp.clone().requires_grad_(True)
    ref = fn(x, blp, adv, m, proximal_logprobs=prox, ess=ess_b, ess_proximal=ess_p)
    ref.loss.backward()
    # the split: statistics summed over micro-batches, as the learner accumulates them
    parts = [slice(s, s + size) for s in range(0, 6, size)]
    st_b, st_p = RatioStats.zeros(), RatioStats.zeros()
    for p in parts:
        b, q = _two_anchor_stats(lp, blp, prox, m, p)
        st_b, st_p = st_b + b, st_p + q
    n = float(m.sum())
    total, grad = 0.0, torch.zeros_like(lp)
    for p in parts:
        xp = lp[p].clone().requires_grad_(True)
        out = fn(xp, blp[p], adv[p], m[p], proximal_logprobs=prox[p], ess=st_b, ess_proximal=st_p, num_tokens=n)
        out.loss.backward()
        total += out.loss.item()
        grad[p] = xp.grad
    assert total == pytest.approx(ref.loss.item(), abs=1e-6)
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=1e-6)
    # and the batch-wide statistics are the ones the single call computes from its own tokens
    own = fn(lp, blp, adv, m, proximal_logprobs=prox)
    assert own.metrics["ess_behavior"] == pytest.approx(ref.metrics["ess_behavior"], abs=1e-6)
    assert own.metrics["ess_proximal"] == pytest.approx(ref.metrics["ess_proximal"], abs=1e-6)
    assert ref.metrics["ess_proximal"] < 0.99  # the proximal anchor is informative in this data


def test_two_anchor_micro_batch_without_batch_stats_differs():
    # the test above can fail: without the batch-wide statistics each micro-batch has its own ESS
    lp, blp, adv, m, prox = _two_anchor_data()
    fn = objectives.get("p3o_two_anchor")
    ref = fn(lp, blp, adv, m, proximal_logprobs=prox).loss.item()
    n = float(m.sum())
    split = sum(fn(lp[p], blp[p], adv[p], m[p], proximal_logprobs=prox[p], num_tokens=n).loss.item()
                for p in (slice(0, 2), slice(2, 4), slice(4, 6)))
    assert abs(split - ref) > 1e-4
