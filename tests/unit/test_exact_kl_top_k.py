"""The exact KL's top-k lower bound (an engine that returns top-k log-probs: vLLM) through the chunked head and the learner.

Reference: the bound written here as what it is, the KL of π_θ and π_b coarse-grained to π_b's k tokens plus one
"other" bucket, Σ_b P_b·log(P_b/Q_b), with π_θ's buckets summed over its whole [.., V] log-softmax in float64
autograd (no code under test: not ``top_k_reference``, which the code computes it through); and the exact KL of the
whole behaviour distribution, which it must not exceed and which it equals at k = V.
"""

import copy
import math

import pytest
import torch

from trustbatch.objectives.kl import Q_OTHER_FLOOR, top_k_kl_lower_bound
from trustbatch.pipeline.batch import build_batch
from trustbatch.policy.chunked_logprobs import (KLReference, RecordedInput, TeacherForced, TopKInput, chunked_logprobs,
                                                full_logprobs)
from trustbatch.policy.forward import Teacher, TopK
from trustbatch.rollout.engine import Rollout
from trustbatch.trainer.learner import Learner

from grad_probe import sgd_recording_grads
from llama_rows import _llama, _rows, full64, perturbed

TOL = 1e-9


def _randn(seed, *shape, scale=2.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _bucket_kl(lp, top_lq, top_ids):
    """Σ_b P_b·log(P_b/Q_b) over the buckets {v} (v among top_ids) and "other", per position; float64 autograd.
    P_o sums π_θ over the tokens outside top_ids (not 1 − Σ_S), Q_o = 1 − Σ_S q."""
    p = lp.exp()
    outside = torch.ones_like(p, dtype=torch.bool).scatter(-1, top_ids, False)
    p_s, q_s = p.gather(-1, top_ids), top_lq.exp()
    p_o, q_o = (p * outside).sum(-1), 1.0 - q_s.sum(-1)
    safe = torch.where(p_o > 0, p_o, 1.0)  # no 0·log 0 (NaN gradient) where the "other" bucket is empty
    return (p_s * (p_s.log() - top_lq)).sum(-1) + torch.where(p_o > 0, p_o * (safe.log() - q_o.log()), 0.0)


def _exact(lp, lq):
    return (lp.exp() * (lp - lq)).sum(-1)


def _head_case(seed, B=5, C=4, H=6, V=9):
    hidden = _randn(seed, B, C, H).requires_grad_(True)
    weight = _randn(seed + 1, V, H, scale=0.8).requires_grad_(True)
    bias = _randn(seed + 2, V, scale=0.5).requires_grad_(True)
    targets = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(seed + 3))
    lq = torch.log_softmax(_randn(seed + 4, B, C, V), -1)  # the behaviour's whole distribution
    mask = torch.ones(B, C, dtype=torch.bool)
    mask[0, :2] = mask[3, :1] = False  # left padding of shorter completions
    return hidden, weight, bias, targets, lq, mask


@pytest.mark.parametrize("chunk", [1, 2, 3, None], ids=["chunk1", "chunk2", "chunk3", "full-path"])
def test_chunked_top_k_bound_and_gradient_equal_the_bucket_kl_over_the_vocabulary(chunk):
    """Rows 0, 2, 3 carry π_b's top 3 (``TopKInput``), rows 1 and 4 its whole distribution (``RecordedInput``): the
    head's KL is the bucket KL at the former and the exact KL at the latter, values and gradients (hidden, weight,
    bias, through both the log-prob and the KL outputs), chunk by chunk (row blocks at chunk < 5) or in one piece."""
    hidden, weight, bias, targets, lq, mask = _head_case(0)
    k, top_rows, full_rows = 3, torch.tensor([0, 2, 3]), torch.tensor([1, 4])
    top_lq, top_ids = lq.topk(k, -1)
    ref = KLReference((TeacherForced((TopKInput(top_lq[top_rows].float(), top_ids[top_rows], rows=top_rows),
                                      RecordedInput(lq[full_rows], rows=full_rows)), 5),), mask)
    g_logp, g_kl = _randn(10, 5, 4), _randn(11, 5, 4).abs()
    if chunk is None:
        logp, _, kl = full_logprobs(torch.nn.functional.linear(hidden, weight, bias), targets, kl_reference=ref)
    else:
        logp, _, kl = chunked_logprobs(hidden, weight, bias, targets, chunk_size=chunk, kl_reference=ref)
    got = torch.autograd.grad((g_logp * logp).sum() + (g_kl * kl).sum(), (hidden, weight, bias))

    lp = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias), -1)
    is_top = torch.zeros(5, dtype=torch.bool).index_fill(0, top_rows, True)[:, None]
    bound = _bucket_kl(lp, top_lq.float().double(), top_ids)
    want_kl = torch.where(mask, torch.where(is_top, bound, _exact(lp, lq)), 0.0)
    want_logp = lp.gather(-1, targets[..., None])[..., 0]
    want = torch.autograd.grad((g_logp * want_logp).sum() + (g_kl * want_kl).sum(), (hidden, weight, bias))
    torch.testing.assert_close(kl, want_kl.detach(), rtol=TOL, atol=1e-12)
    torch.testing.assert_close(logp, want_logp.detach(), rtol=TOL, atol=1e-12)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, w, rtol=TOL, atol=1e-11, msg=name)
    # a lower bound on the exact KL, with a real gap on these random distributions, and 0 at padding
    exact = _exact(lp, lq).detach()
    kl = kl.detach()
    assert bool((kl <= exact + 1e-12).all()) and float((exact - kl)[is_top.expand(-1, 4) & mask].max()) > 1e-2
    assert float(kl[~mask].abs().max()) == 0.0


@pytest.mark.parametrize("V, k", [(5, 1), (7, 3), (9, 6), (11, 2)])
def test_the_bound_stays_below_the_exact_kl_and_reaches_it_at_k_equal_v(V, k):
    """Random distributions at several temperatures: 0 ≤ bound ≤ exact; k = V (every token a bucket) gives the
    exact KL and its gradient, through the chunked head."""
    for seed, scale in ((1, 0.5), (2, 2.0), (3, 5.0)):
        lp = torch.log_softmax(_randn(seed, 64, V, scale=scale), -1)
        lq = torch.log_softmax(_randn(seed + 100, 64, V, scale=scale), -1)
        top_lq, top_ids = lq.topk(k, -1)
        bound = top_k_kl_lower_bound(lp, top_lq, top_ids)
        assert bool((bound >= -1e-12).all()) and bool((bound <= _exact(lp, lq) + 1e-12).all()), (V, k, scale)
        # the bucket KL, except where π_b's "other" mass is below the floor: there lower still
        floored = 1.0 - top_lq.exp().sum(-1) < Q_OTHER_FLOOR
        buckets = _bucket_kl(lp, top_lq, top_ids)
        torch.testing.assert_close(bound[~floored], buckets[~floored], rtol=TOL, atol=1e-12)
        assert bool((bound[floored] <= buckets[floored]).all())

    hidden, weight, bias, targets, lq, mask = _head_case(4, V=V)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(9)).expand(5, 4, V).contiguous()
    every = (TopKInput(lq.gather(-1, ids), ids), RecordedInput(lq))  # every token given, in a shuffled order
    out = []
    for part in every:
        kl = chunked_logprobs(hidden, weight, bias, targets, chunk_size=2,
                              kl_reference=KLReference((TeacherForced((part,), 5),), mask))[2]
        out.append((kl.detach(), torch.autograd.grad(kl.sum(), (hidden, weight))))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=TOL, atol=1e-12)
    for g, w in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(g, w, rtol=TOL, atol=1e-12)


def test_other_mass_below_float32_resolution_is_floored_and_stays_a_lower_bound():
    """π_b with top-3 mass 1 − 1e-9 (float32 log-probs sum to 1 or more): Q_o is taken as 2^-23, not 0, so π_θ's
    "other" mass costs P_o·log(P_o/2^-23) rather than P_o·87 nats; below the exact KL."""
    lq = torch.log(torch.tensor([0.6, 0.3, 0.1 - 1e-9 - 3e-10, 1e-10, 1e-10, 1e-10], dtype=torch.float64))
    lp = torch.log_softmax(torch.tensor([1.0, 0.5, 0.0, -3.0, -3.0, -3.0], dtype=torch.float64), -1)
    top_lq, top_ids = lq.topk(3)
    got = top_k_kl_lower_bound(lp, top_lq.float().double(), top_ids)
    p = lp.exp()
    p_o = float(p[3:].sum())
    head = float((p[:3] * (lp[:3] - top_lq.float().double())).sum())
    assert float(got) == pytest.approx(head + p_o * math.log(p_o / Q_OTHER_FLOOR), rel=1e-12)
    assert float(got) <= float(_exact(lp, lq))


def test_a_mixture_with_a_top_k_behaviour_is_refused():
    lq = torch.log_softmax(_randn(0, 2, 3, 5), -1)
    top = TeacherForced((TopKInput(*lq.topk(2, -1)),), 2)
    with pytest.raises(ValueError, match="top-k behaviour alone"):
        KLReference((top, lq), torch.ones(2, 3, dtype=torch.bool), (0.0, 0.0))
    with pytest.raises(ValueError, match="pass lsm"):
        top.log_probs(slice(None), torch.float64)


# ---- through the learner: batch from Rollout records, P3O loss and gradients, the logged bound -------------------


T_B, K = 0.7, 5


def _rollouts(prompts, comps, engine, foreign, foreign_rows):
    """Rollout records as a top-k engine returns them (float32 log-probs; the top K of each step, largest first), the
    rows in ``foreign_rows`` sampled by ``foreign`` (a model the learner rebuilds) instead."""
    from trustbatch.policy.forward import pack

    packed = pack(prompts, comps, pad_id=0)
    C = packed.response_mask.shape[1]
    with torch.no_grad():
        lq_engine, lq_foreign = full64(engine, packed, T_B), full64(foreign, packed)
    out = []
    for i, (p, c) in enumerate(zip(prompts, comps)):
        own = i not in foreign_rows
        lq = (lq_engine if own else lq_foreign)[i, C - len(c):]
        top = lq.topk(K, -1)
        out.append(Rollout(i, p, c, lq.gather(-1, torch.tensor(c)[:, None])[:, 0].float().tolist(), False,
                           0 if own else -1, behavior_top_logprobs=top.values.float() if own else None,
                           behavior_top_ids=top.indices if own else None))
    return out, lq_engine, lq_foreign


@pytest.mark.parametrize("case", ["chunked", "full-path", "foreign-rows"])
def test_learner_takes_the_top_k_bound_and_logs_it_as_such(case):
    """P3O with kl=exact on a batch whose engine returned its top K (``TopK``): loss, ESS and every gradient equal
    a float64 brute force with the bucket KL (the exact KL at foreign rows, whose model the learner rebuilds);
    the step logs ``kl_behavior_bound`` (the token mean of that KL), not ``kl_behavior``."""
    model = _llama()
    engine, foreign = perturbed(model, 1), perturbed(model, 2)
    prompts, comps = _rows()
    foreign_rows = set(range(0, len(prompts), 3)) if case == "foreign-rows" else set()
    rollouts, lq_engine, lq_foreign = _rollouts(prompts, comps, engine, foreign, foreign_rows)
    adv = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    behaviour = {0: TopK(K), -1: Teacher(foreign)} if foreign_rows else {0: TopK(K)}
    batch = build_batch(rollouts, adv, pad_id=0, behaviour=behaviour)
    assert batch.behavior_top_logprobs.shape == (*batch.packed.response_mask.shape, K)
    learner = Learner(model, "p3o", {"kl": "exact"}, micro_batch_size=5,
                      logprob_chunk_size=None if case == "full-path" else 2)
    learner.grad_clip = 1e9
    steps = []
    sgd_recording_grads(learner, model, steps)
    start = copy.deepcopy(model)
    metrics = learner.train_on(batch)

    # brute force, float64 over the whole vocabulary, from the rollouts' own top-k (not the batch's layout)
    mask, packed = batch.packed.response_mask, batch.packed
    C = mask.shape[1]
    lpf = full64(start, packed)
    lp = lpf.gather(-1, packed.input_ids[:, -C:, None])[..., 0]
    blp = batch.behavior_logprobs.double()
    kl = torch.zeros_like(lp)
    for i, r in enumerate(rollouts):
        n = len(r.completion_ids)
        if r.policy_version < 0:
            kl[i, C - n:] = _exact(lpf[i, C - n:], lq_foreign[i, C - n:])
        else:
            kl[i, C - n:] = _bucket_kl(lpf[i, C - n:], r.behavior_top_logprobs.double(), r.behavior_top_ids)
    rho = (lp.detach() - blp).exp()[mask]
    e = rho.sum() ** 2 / (rho.numel() * (rho * rho).sum())
    adv = batch.advantages.double()[:, None]  # float32 in the batch, as the learner takes it
    per_token = -torch.minimum((lp.detach() - blp).exp(), e) * adv * lp + (1 - e) * kl
    loss = torch.where(mask, per_token, 0.0).sum() / mask.sum()
    loss.backward()
    ((_, got),) = steps
    for name, p in start.named_parameters():
        scale = float(p.grad.abs().max())
        assert float((got[name] - p.grad).abs().max()) <= TOL * scale, name
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=TOL)
    assert metrics["ess"] == pytest.approx(float(e), rel=TOL)
    bound = float(kl.detach()[mask].mean())
    assert "kl_behavior" not in metrics and metrics["kl_behavior_bound"] == pytest.approx(bound, rel=TOL)
    # below the exact KL against the engine's whole distribution, by a margin K = 5 of V = 40 leaves here
    own = mask & (batch.policy_version >= 0)[:, None]
    exact = _exact(lpf, lq_engine).detach()
    assert bound > 1e-3 and float(kl.detach()[own].sum()) < float(exact[own].sum()) - 1e-3
