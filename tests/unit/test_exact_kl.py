"""The exact full-distribution behaviour KL (P3O ``kl="exact"``): value, gradient, learner plumbing, engine, refusals.

References are computed independently of the code under test: a Python double loop over the
vocabulary, ``torch.distributions.kl_divergence`` in float64 autograd, and a float64 re-implementation
of the P3O loss (arXiv 2605.12380 Eq. 11-12) on a float64 copy of the model.
"""

import copy
import math

import pytest
import torch

from trustbatch import objectives
from trustbatch.errors import UserError
from trustbatch.objectives.kl import exact_kl, k3
from trustbatch.pipeline.batch import build_batch
from trustbatch.policy import load_policy
from trustbatch.policy.forward import Teacher, pack
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.rollout import SamplingParams, TransformersEngine
from trustbatch.rollout.engine import Rollout
from trustbatch.trainer import Learner, TrainBatch

from grad_probe import sgd_recording_grads


def _logits(seed, *shape, scale=3.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- the estimator ------------------------------------------------------------------------------


def test_exact_kl_equals_a_double_loop_over_the_vocabulary():
    z, b = _logits(0, 2, 3, 7), _logits(1, 2, 3, 7)
    got = exact_kl(torch.log_softmax(z, -1), torch.log_softmax(b, -1))
    for i in range(2):
        for t in range(3):
            zs, bs = z[i, t].tolist(), b[i, t].tolist()
            nz, nb = sum(math.exp(x) for x in zs), sum(math.exp(x) for x in bs)
            want = 0.0
            for v in range(7):
                p, q = math.exp(zs[v]) / nz, math.exp(bs[v]) / nb
                want += p * math.log(p / q)
            assert got[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert exact_kl(torch.log_softmax(z, -1), torch.log_softmax(z, -1)).abs().max() < 1e-15


def test_exact_kl_gradient_wrt_logits_matches_float64_autograd_of_torch_distributions():
    z, b = _logits(2, 3, 4, 11), _logits(3, 3, 4, 11)
    w = _logits(4, 3, 4, scale=1.0)  # a random cotangent, so every position's gradient counts
    z1 = z.clone().requires_grad_(True)
    (exact_kl(torch.log_softmax(z1, -1), torch.log_softmax(b, -1)) * w).sum().backward()
    z2 = z.clone().requires_grad_(True)
    ref = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=z2),
                                            torch.distributions.Categorical(logits=b))
    (ref * w).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=0, atol=1e-9)
    # and the closed form π_θ(u)·(log π_θ(u) − log π_b(u) − KL)
    p, d = torch.softmax(z, -1), torch.log_softmax(z, -1) - torch.log_softmax(b, -1)
    kl = (p * d).sum(-1, keepdim=True)
    torch.testing.assert_close(z1.grad, w[..., None] * p * (d - kl), rtol=0, atol=1e-9)


def test_exact_kl_gradient_stays_bounded_where_k3_blows_up():
    """At a sampled token with ρ = π_θ/π_b ≈ 8e-6, k3's gradient is ~1/ρ; the exact KL's stays ≤ 2·max|log π_θ − log π_b|."""
    V = 5
    z = torch.zeros(V, dtype=torch.float64)  # π_θ uniform
    b = torch.tensor([-12.0, 0, 0, 0, 0], dtype=torch.float64)  # π_b(0) ≈ 2.5e-6
    # k3 gradient w.r.t. log π_θ at a token with ρ → 0 is 1 − 1/ρ: take token 1 from a π_θ that avoids it
    zt = torch.tensor([0.0, -12, 0, 0, 0], dtype=torch.float64).requires_grad_(True)
    lp = torch.log_softmax(zt, -1)
    k3(lp[1] - torch.log_softmax(torch.zeros(V, dtype=torch.float64), -1)[1]).backward()
    assert zt.grad.abs().max() > 1e3  # 1/ρ ≈ e^12 scaled by the softmax Jacobian
    for logits_theta, logits_b in ((z, b), (zt.detach(), torch.zeros(V, dtype=torch.float64))):
        x = logits_theta.clone().requires_grad_(True)
        lq = torch.log_softmax(logits_b, -1)
        exact_kl(torch.log_softmax(x, -1)[None], lq[None]).sum().backward()
        bound = 2 * (torch.log_softmax(logits_theta, -1) - lq).abs().max()
        assert x.grad.abs().max() <= bound


# ---- P3O with kl="exact" through the learner ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3", "State the answer"], vocab_size=300)
    model = build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=32, seed=0, tokenizer=tok)
    return tok, model


def _full_logprobs64(model, packed, temperature=1.0):
    """[B, C, V] float64 log-softmax at the completion positions, from a plain full-sequence forward."""
    m = copy.deepcopy(model).double()
    logits = m(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
               position_ids=packed.position_ids).logits
    C = packed.response_mask.shape[1]
    return torch.log_softmax(logits[:, -C - 1:-1] / temperature, -1)


def _batch(tok, model, seed=0, temperature=0.6):
    """3 prompts × 2 completions; the behaviour is a perturbed copy of ``model`` sampled at ``temperature``, handed
    to the learner as its ``Teacher`` (the batch stores no [B, C, V] tensor)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(3, len(tok), (int(n),), generator=g).tolist() for n in (2, 4, 3)]
    comps = [torch.randint(3, len(tok), (int(n),), generator=g).tolist() + [2] for n in (0, 3, 2, 1, 3, 2)]
    packed = pack([p for p in prompts for _ in range(2)], comps, 0)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    with torch.no_grad():
        blp_full = _full_logprobs64(behaviour, packed, temperature)
    C = packed.response_mask.shape[1]
    blp = blp_full.gather(-1, packed.input_ids[:, -C:, None]).squeeze(-1).to(model.dtype)
    m = packed.response_mask
    return TrainBatch(packed, torch.where(m, blp, 0.0), torch.randn(6, generator=g, dtype=model.dtype),
                      behaviour={0: Teacher(behaviour, temperature)})


def _behaviour_full64(batch):
    """[B, C, V] float64 log π_b of the batch's behaviour model (its only teacher), from a plain forward."""
    (t,) = batch.behaviour.values()
    return _full_logprobs64(t.model, batch.packed, t.temperature)


def _p3o_exact_grads64(model, batch):
    """P3O with the exact KL written out in float64: −sg(min(ρ, e))·A·log π_θ + (1 − e)·KL_t, token mean."""
    m64 = copy.deepcopy(model).double()
    logits = m64(input_ids=batch.packed.input_ids, attention_mask=batch.packed.attention_mask,
                 position_ids=batch.packed.position_ids).logits
    mask = batch.packed.response_mask
    C = mask.shape[1]
    lp_full = torch.log_softmax(logits[:, -C - 1:-1], -1)
    lp = lp_full.gather(-1, batch.packed.input_ids[:, -C:, None]).squeeze(-1)
    blp, blp_full = batch.behavior_logprobs.double(), _behaviour_full64(batch)
    rho = torch.where(mask, (lp.detach() - blp).exp(), 0.0)
    n = mask.sum()
    e = rho.sum() ** 2 / (n * (rho * rho).sum())
    kl_t = (lp_full.exp() * (lp_full - blp_full)).sum(-1)
    adv = batch.advantages.double()[:, None]
    per_token = -torch.minimum(rho, e) * adv * lp + (1 - e) * kl_t
    loss = torch.where(mask, per_token, 0.0).sum() / n
    loss.backward()
    return {k: p.grad for k, p in m64.named_parameters()}, float(e)


@pytest.mark.parametrize("micro, shared_prompt", [(6, True), (4, True), (4, False)])
def test_p3o_exact_through_the_learner_equals_a_direct_float64_computation(tiny, micro, shared_prompt):
    tok, model = tiny
    batch = _batch(tok, model)
    m = copy.deepcopy(model)
    learner = Learner(m, "p3o", {"kl": "exact"}, micro_batch_size=micro, shared_prompt=shared_prompt)
    grads = sgd_recording_grads(learner, m)
    learner.grad_clip = 1e9  # compare the raw gradient
    metrics = learner.step(batch)
    want, e = _p3o_exact_grads64(model, batch)
    assert math.isfinite(metrics["loss"]) and metrics["nonfinite_skipped"] == 0
    assert metrics["ess"] == pytest.approx(e, rel=1e-6)
    assert e < 0.95  # off-policy enough that the KL term carries weight
    scale = max(float(g.abs().max()) for g in want.values())
    for k, g in want.items():
        torch.testing.assert_close(grads[k].double(), g, rtol=0, atol=1e-6 * scale)


def test_p3o_exact_and_k3_differ_through_the_learner(tiny):
    """The option reaches the objective: the same batch gives another gradient with k3."""
    tok, model = tiny
    batch = _batch(tok, model, seed=1)
    out = {}
    for kl in ("k3", "exact"):
        m = copy.deepcopy(model)
        learner = Learner(m, "p3o", {"kl": kl})
        out[kl] = sgd_recording_grads(learner, m)
        learner.grad_clip = 1e9
        learner.step(batch)
    assert max(float((out["k3"][k] - out["exact"][k]).abs().max()) for k in out["k3"]) > 1e-4


def test_p3o_two_anchor_exact_equals_a_brute_force_mixture_kl():
    g = torch.Generator().manual_seed(5)
    B, T, V = 2, 3, 6
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    z = _logits(6, B, T, V).requires_grad_(True)
    lpf = torch.log_softmax(z, -1)
    bf, pf = torch.log_softmax(_logits(7, B, T, V), -1), torch.log_softmax(_logits(8, B, T, V), -1)
    idx = torch.randint(0, V, (B, T, 1), generator=g)
    lp, blp, plp = (t.gather(-1, idx).squeeze(-1) for t in (lpf, bf, pf))
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    out = objectives.get("p3o_two_anchor")(lp, blp, adv, mask, proximal_logprobs=plp, kl="exact",
                                           logprobs_full=lpf, behavior_logprobs_full=bf, proximal_logprobs_full=pf)
    # by hand: e_b, e_p, mixture weights, the mixture's KL as a loop over the vocabulary
    def ess(r):
        r = r[mask]
        return float(r.sum() ** 2 / (r.numel() * (r * r).sum()))
    e_b, e_p = ess((lp - blp).detach().exp()), ess((lp - plp).detach().exp())
    e_mix, w_b, w_p = min(e_b, e_p), 1 - e_b, 1 - e_p
    total, n = 0.0, int(mask.sum())
    P, Q, R = lpf.detach().exp(), bf.exp(), pf.exp()
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            rho = math.exp(float(lp[i, t].detach() - blp[i, t]))
            kl = sum(float(P[i, t, v]) * math.log(float(P[i, t, v]) / ((w_b * float(Q[i, t, v]) + w_p * float(R[i, t, v])) / (w_b + w_p)))
                     for v in range(V))
            total += -min(rho, e_mix) * float(adv[i]) * float(lp[i, t].detach()) + (1 - e_mix) * kl
    assert out.metrics["loss"] == pytest.approx(total / n, rel=1e-10)


@pytest.mark.parametrize("objective", ["p3o", "p3o_two_anchor"])
def test_the_behaviour_and_proximal_distributions_take_no_gradient(objective):
    """π_b and the proximal policy are constants of the loss (a stop-gradient, as the [B, T] log-probs are): a
    caller's [B, T, V] inputs built from the policy's own logits (on-policy at T = 0.7) left a path for the
    gradient through them. The gradient w.r.t. the policy's logits equals the one with those inputs detached."""
    B, T, V = 2, 3, 6
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    idx = torch.randint(0, V, (B, T, 1), generator=torch.Generator().manual_seed(1))
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)

    def grad(detached: bool) -> torch.Tensor:
        z = _logits(6, B, T, V).requires_grad_(True)
        lpf = torch.log_softmax(z, -1)
        bf, pf = torch.log_softmax(z / 0.7, -1), torch.log_softmax(z * 0.9, -1)
        if detached:
            bf, pf = bf.detach(), pf.detach()
        lp, blp, plp = (t.gather(-1, idx).squeeze(-1) for t in (lpf, bf, pf))
        extra = dict(proximal_logprobs=plp.detach(), proximal_logprobs_full=pf) if objective == "p3o_two_anchor" else {}
        out = objectives.get(objective)(lp, blp.detach(), adv, mask, kl="exact", logprobs_full=lpf,
                                        behavior_logprobs_full=bf, **extra)
        out.loss.backward()
        return z.grad

    assert torch.equal(grad(False), grad(True))


# ---- the engine keeps the sampled tokens' log-probs and hands its teacher ----------------------------


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_engine_logprobs_and_teacher_rebuild_the_sampled_distribution(shared_dir, temperature):
    """The recorded log-probs are the tempered distribution's at the sampled tokens (an independent forward over
    prompt + completion), and the batch's teacher, teacher-forced, rebuilds that whole distribution."""
    from trustbatch.policy.forward import teacher_forced

    policy = load_policy(shared_dir / "models" / "stories260K-hf")
    engine = TransformersEngine(policy.model, policy.eos_id, policy.pad_id)
    prompts = [policy.encode_prompt(t) for t in ("Once upon a time", "The cat sat")]
    sp = SamplingParams(temperature=temperature, max_new_tokens=8)
    ro = engine.generate(prompts, 3, sp, seeds=[1, 2])
    batch = build_batch(ro, torch.zeros(len(ro)), policy.pad_id, behaviour={engine.version: engine.teacher(sp)})
    C = batch.packed.response_mask.shape[1]
    rebuilt = teacher_forced(batch.packed, [(None, batch.behaviour[engine.version])]).log_probs(slice(None), torch.float64)
    for i, r in enumerate(ro):
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0, len(r.prompt_ids) - 1:-1].double()
        want = torch.log_softmax(logits / temperature, -1)
        n = len(r.completion_ids)
        at = want.gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.behavior_logprobs, dtype=torch.float64), at, rtol=0, atol=1e-4)
        torch.testing.assert_close(rebuilt[i, C - n:], want, rtol=0, atol=1e-4)  # float32 at |log p| up to ~20
    with pytest.raises(ValueError, match=r"top_p=0.9 truncates the behaviour distribution"):
        engine.teacher(SamplingParams(top_p=0.9))


# ---- refusals ----------------------------------------------------------------------------------


def test_validate_options_refuses_exact_without_full_behaviour_logprobs():
    for name in ("p3o", "p3o_two_anchor"):
        with pytest.raises(ValueError, match=r"kl='exact' needs the behaviour policy's full log-probs") as e:
            objectives.validate_options(name, {"kl": "exact"})
        assert "\n" not in str(e.value)
        assert objectives.validate_options(name, {"kl": "exact"}, supplied={"behavior_logprobs_full"}) == {"kl": "exact"}
        assert objectives.spec(name).needs_full_logprobs({"kl": "exact"})
        assert not objectives.spec(name).needs_full_logprobs({})
    with pytest.raises(ValueError, match="supplied by the trainer"):
        objectives.validate_options("p3o", {"behavior_logprobs_full": 1})


@pytest.mark.parametrize("extra, match", [
    (["rollout.engine=vllm", "objective.name=p3o_two_anchor"],
     r"rollout.engine=vllm returns top-k log-probs, whose lower bound does not carry over to the mixture"),
    (["rollout.top_p=0.9"], r"top-p sampling \(rollout.top_p=0.9\) gives π_b = 0 outside the nucleus"),
    (["rollout.mode=async", "rollout.precision=bfloat16"],
     r"rollout.mode=async rebuilds each batch's behaviour from the weights the learner pushed, which teacher forcing "
     r"reproduces only where the engine declares full \(rollout.engine=transformers at rollout.precision=bfloat16 "
     r"declares recorded"),
    (["rollout.mode=async", "orchestrator=ray", "ray_learners=0", "rollout.precision=bfloat16"],
     r"rollout.engine=transformers at rollout.precision=bfloat16 declares recorded, which its workers do not send"),
    (["rollout.mode=async", "orchestrator=ray"], r"Ray learner actors \(ray_learners=1\) are not handed the rebuilt"),
    (["objective.name=p3o_two_anchor", "train.strategy=fsdp2"], r"proximal model would be the FSDP2-sharded"),
])
def test_preflight_refuses_exact_kl_where_the_rollout_cannot_supply_it(extra, match):
    from trustbatch.config import load_config
    from trustbatch.recipes.build import check_objective

    check_objective(load_config(None, ["objective.options={kl: exact}"]))  # the transformers engine can
    # the learner rebuilds the workers' behaviour, the packed one too; vLLM workers send their top-k log-probs
    for fine in (["rollout.mode=async"], ["rollout.mode=async", "orchestrator=ray", "ray_learners=0"],
                 ["train.padding_free=true"], ["rollout.mode=async", "rollout.engine=vllm"],
                 ["rollout.mode=async", "rollout.engine=vllm", "orchestrator=ray", "ray_learners=0"]):
        check_objective(load_config(None, ["objective.options={kl: exact}", *fine]))
    cfg = load_config(None, ["objective.options={kl: exact}", *extra])
    with pytest.raises(UserError, match=match) as e:
        check_objective(cfg)
    assert "\n" not in str(e.value)
    check_objective(load_config(None, extra))  # k3 runs there


def test_preflight_reads_the_engines_declaration_for_the_exact_kl(monkeypatch):
    """The refusal follows what the engine declares (``rollout.spec.behaviour_distribution``), not its name: vLLM's
    ``top_k`` runs (the lower bound), an engine declaring ``none`` is refused in one line; ``rollout.logprobs_top_k``
    is refused where nothing reads it."""
    from trustbatch.config import load_config
    from trustbatch.recipes import checks

    exact = ["objective.options={kl: exact}"]
    checks.check_objective(load_config(None, [*exact, "rollout.engine=vllm"]))
    checks.check_objective(load_config(None, [*exact, "rollout.engine=vllm", "rollout.logprobs_top_k=50"]))
    for extra in (["rollout.engine=vllm"], [*exact]):  # kl=k3 on vLLM, kl=exact on the transformers engine
        with pytest.raises(UserError, match=r"rollout.logprobs_top_k=50 is read only with objective kl=exact") as e:
            checks.check_objective(load_config(None, [*extra, "rollout.logprobs_top_k=50"]))
        assert "\n" not in str(e.value)
    monkeypatch.setattr(checks, "behaviour_distribution", lambda spec: "none")
    for extra in ([], ["rollout.mode=async"]):  # async workers send nothing of it either
        with pytest.raises(UserError, match=r"rollout.engine=transformers returns none of its sampling distribution "
                                            r"beyond the sampled tokens") as e:
            checks.check_objective(load_config(None, [*exact, *extra]))
        assert "\n" not in str(e.value)
    checks.check_objective(load_config(None, []))  # k3 needs nothing of it


def test_p3o_exact_refuses_missing_truncated_or_unnormalised_inputs():
    B, T, V = 2, 3, 5
    lpf = torch.log_softmax(_logits(9, B, T, V), -1)
    bf = torch.log_softmax(_logits(10, B, T, V), -1)
    lp, blp = lpf[..., 0], bf[..., 0]
    adv, mask = torch.ones(B), torch.ones(B, T, dtype=torch.bool)
    p3o = objectives.get("p3o")
    with pytest.raises(ValueError, match=r"kl='exact' needs behavior_logprobs_full="):
        p3o(lp, blp, adv, mask, kl="exact", logprobs_full=lpf)
    with pytest.raises(ValueError, match=r"only used by kl='exact'"):
        p3o(lp, blp, adv, mask, logprobs_full=lpf, behavior_logprobs_full=bf)
    truncated = bf.clone()
    truncated[0, 1, 3] = float("-inf")  # top-p dropped token 3
    with pytest.raises(ValueError, match=r"truncated behaviour distribution .*top_p=1"):
        p3o(lp, blp, adv, mask, kl="exact", logprobs_full=lpf, behavior_logprobs_full=truncated)
    with pytest.raises(ValueError, match=r"behavior_logprobs_full is not normalised"):
        p3o(lp, blp, adv, mask, kl="exact", logprobs_full=lpf, behavior_logprobs_full=bf + 0.5)
    with pytest.raises(ValueError, match=r"has shape \(2, 3, 4\)"):
        p3o(lp, blp, adv, mask, kl="exact", logprobs_full=lpf, behavior_logprobs_full=bf[..., :4])
    # masked positions may hold anything, as for the [B, T] inputs
    mask2 = mask.clone()
    mask2[0, 1] = False
    out = p3o(lp, blp, adv, mask2, kl="exact", logprobs_full=lpf, behavior_logprobs_full=truncated)
    assert math.isfinite(out.metrics["loss"])


def test_learner_and_batch_refuse_missing_behaviour_models(tiny):
    tok, model = tiny
    batch = _batch(tok, model)
    no_model = TrainBatch(batch.packed, batch.behavior_logprobs, batch.advantages)
    learner = Learner(copy.deepcopy(model), "p3o", {"kl": "exact"})
    with pytest.raises(ValueError, match=r"kl='exact' needs the behaviour model, but the batch has none"):
        learner.step(no_model)
    other = TrainBatch(batch.packed, batch.behavior_logprobs, batch.advantages, behaviour={3: batch.behaviour[0]})
    with pytest.raises(ValueError, match=r"policy version\(s\) \[0\] have none"):
        learner.step(other)
    ro = [Rollout(0, [1, 5], [6, 2], [-1.0, -1.0], False, 0), Rollout(0, [1, 5], [7, 2], [-1.0, -1.0], False, -1)]
    with pytest.raises(ValueError, match=r"no behaviour model for policy version\(s\) \[-1\]"):
        build_batch(ro, torch.zeros(2), 0, behaviour={0: batch.behaviour[0]})


def test_p3o_exact_replayed_over_mini_batches_equals_float64_per_mini_batch(tiny):
    """Replay (2 mini-batches, the lab's `replay` arms): each optimizer step's gradient is the float64 P3O-exact
    gradient of that step's rows alone, at the weights the previous step left, so the full behaviour
    log-probs are sliced with the rows they belong to and the ESS is the mini-batch's."""
    tok, model = tiny
    batch = _batch(tok, model, seed=2)
    m = copy.deepcopy(model)
    learner = Learner(m, "p3o", {"kl": "exact"}, minibatches=2)
    learner.grad_clip = 1e9
    steps = []  # (weights before the step, gradient it used)
    sgd_recording_grads(learner, m, steps)
    torch.manual_seed(123)
    rows = torch.randperm(len(batch)).chunk(2)  # the learner draws its epoch's order from the global stream
    torch.manual_seed(123)
    metrics = learner.train_on(batch)
    assert metrics["optimizer_steps"] == 2 and len(steps) == 2
    for (weights, got), idx in zip(steps, rows):
        want, _ = _p3o_exact_grads64(weights, batch.select(idx))
        scale = max(float(g.abs().max()) for g in want.values())
        for k, g in want.items():
            torch.testing.assert_close(got[k].double(), g, rtol=0, atol=1e-6 * scale)
    # the second step ran on weights the first one moved, so the check saw a replayed (off-policy) step
    assert any(not torch.equal(p, q) for p, q in zip(steps[0][0].parameters(), steps[1][0].parameters()))


# ---- the top-k lower bound (engines that return top-k behaviour log-probs) ---------------------------------


@pytest.mark.parametrize("k", [1, 3, 5, 6, 7])
def test_top_k_bound_is_the_coarse_grained_kl_below_the_exact_one(k):
    """Against a double loop: KL of (π_θ, π_b) coarse-grained to π_b's top k plus one "other" bucket; ≤ the exact
    KL on random distributions, equal at k = V; the gap is P_o·KL of the tails (the chain rule)."""
    from trustbatch.objectives.kl import top_k_kl_lower_bound

    B, T, V = 3, 4, 7
    z = _logits(20 + k, B, T, V).requires_grad_(True)
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(_logits(40 + k, B, T, V), -1)
    top_lq, top_ids = lq.topk(k, -1)
    got = top_k_kl_lower_bound(lp, top_lq, top_ids)
    exact = exact_kl(lp, lq)
    for i in range(B):
        for t in range(T):
            P, Q = lp[i, t].detach().exp().tolist(), lq[i, t].exp().tolist()
            S = set(top_ids[i, t].tolist())
            want = sum(P[v] * math.log(P[v] / Q[v]) for v in S)
            p_o, q_o = sum(P[v] for v in range(V) if v not in S), sum(Q[v] for v in range(V) if v not in S)
            if p_o > 0:
                want += p_o * math.log(p_o / q_o)
                tail = sum(P[v] / p_o * math.log((P[v] / p_o) / (Q[v] / q_o)) for v in range(V) if v not in S)
            else:
                tail = 0.0
            assert got[i, t].item() == pytest.approx(want, rel=1e-10, abs=1e-13)
            assert exact[i, t].item() - got[i, t].item() == pytest.approx(p_o * tail, rel=1e-8, abs=1e-10)
    assert bool((got <= exact + 1e-10).all())
    if k >= V - 1:  # no tail, or a one-token tail, whose conditional KL is 0
        torch.testing.assert_close(got, exact, rtol=1e-11, atol=1e-12)
    else:
        assert float((exact - got).detach().max()) > 1e-3  # a real gap on random distributions
    got.sum().backward()
    assert bool(torch.isfinite(z.grad).all())
    gz = z.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: top_k_kl_lower_bound(torch.log_softmax(x, -1), top_lq, top_ids), (gz,))


def test_engine_precisions_declare_rebuilt_or_recorded_and_preflight_accepts_both():
    """The transformers engine declares, as data, where teacher forcing rebuilds its distribution (float32: "full")
    and where it records it instead (every other precision: "recorded"); both give the exact KL a whole
    distribution, so preflight accepts kl="exact" at each, and an engine asked to record at float32 refuses."""
    from trustbatch.config import load_config
    from trustbatch.recipes.build import check_objective, engine_spec
    from trustbatch.rollout import EngineSpec, TransformersEngine, behaviour_distribution
    from trustbatch.rollout.shifts import PRECISIONS

    for p in PRECISIONS:
        assert behaviour_distribution(EngineSpec(precision=p)) == ("full" if p == "float32" else "recorded"), p
        cfg = load_config(None, ["objective.options={kl: exact}", f"rollout.precision={p}"])
        check_objective(cfg)
        assert engine_spec(cfg).record and not engine_spec(load_config(None, [f"rollout.precision={p}"])).record
    with pytest.raises(ValueError, match="rebuilt by the learner"):
        TransformersEngine(torch.nn.Linear(2, 2), eos_id=1, pad_id=0, record=True)
