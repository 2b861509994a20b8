"""The learner's batch-scope ESS over micro-batches gives the single-batch update."""

import copy

import pytest
import torch

from trustbatch.policy.forward import pack
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.trainer import Learner, TrainBatch

from grad_probe import step_gradients
from llama_rows import learner_batch as _batch


@pytest.fixture(scope="module")
def tiny():
    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3", "State the answer"], vocab_size=300)
    model = build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=32, seed=0, tokenizer=tok).double()
    return tok, model


def _grads(model, batch, micro, objective="p3o"):
    m = copy.deepcopy(model)
    learner = Learner(m, objective, micro_batch_size=micro, lr=0.0)
    return step_gradients(learner, m, batch)


def test_micro_batches_give_the_single_batch_gradient(tiny):
    tok, model = tiny
    b = _batch(tok)
    b.behavior_logprobs = b.behavior_logprobs.double()
    g_full, m_full = _grads(model, b, micro=6)
    for micro in (1, 2, 4):
        g, m = _grads(model, b, micro=micro)
        assert m["ess"] == pytest.approx(m_full["ess"], rel=1e-9)
        assert m_full["ess"] < 0.9  # off-policy enough for the ESS to matter
        for n in g_full:
            torch.testing.assert_close(g[n], g_full[n], rtol=1e-6, atol=1e-9)


def test_cap_weight_removed_is_the_batch_ratio_over_micro_batches(tiny):
    """Σ|A|·(ρ − min(ρ, e_B)) / Σ|A|·ρ over the whole batch, whatever the micro-batching, including a micro-batch
    whose advantages are all 0 (it adds nothing to either sum), against the sums written out from a plain forward."""
    from trustbatch.policy.forward import response_logprobs

    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    b.advantages = b.advantages.double()
    b.advantages[:2] = 0.0  # with micro=2 the first micro-batch has no advantage at all
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.packed)
    m = b.packed.response_mask
    rho = (logp - b.behavior_logprobs).exp()[m]
    e = float(rho.sum() ** 2 / (rho.numel() * (rho * rho).sum()))  # Eq. 11, normalized ESS
    a = b.advantages[:, None].expand_as(logp)[m].abs()
    want = float(((rho - rho.clamp(max=e)) * a).sum() / (rho * a).sum())
    assert 0.01 < want < 0.99  # the cap does something, and not everything
    for micro in (6, 2, 1):
        _, metrics = _grads(model, b, micro=micro)
        assert metrics["cap_weight_removed"] == pytest.approx(want, rel=1e-6), micro  # ρ is float32 in the objective


def test_batch_ess_honours_the_objectives_log_ratio_clip_over_micro_batches(tiny):
    """e_B (Eq. 11) of ρ = exp(clamp(log π_θ − log π_b, ±L)) at the user's L, written out from a plain forward, for one
    micro-batch (the objective computes it) and for several (the learner sums the statistics over them)."""
    from trustbatch.policy.forward import response_logprobs

    tok, model = tiny
    b = _batch(tok, seed=5)
    b.behavior_logprobs = b.behavior_logprobs.double()
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.packed)
    m = b.packed.response_mask
    log_ratio = (logp - b.behavior_logprobs)[m]
    clip = 1.0
    assert float((log_ratio.abs() > clip).double().mean()) > 0.2  # the clip changes many ratios
    rho = log_ratio.clamp(-clip, clip).exp()
    want = float(rho.sum() ** 2 / (rho.numel() * (rho * rho).sum()))
    unclipped = log_ratio.clamp(-20, 20).exp()
    assert abs(want - float(unclipped.sum() ** 2 / (unclipped.numel() * (unclipped * unclipped).sum()))) > 0.05
    for micro in (6, 2, 1):
        learner = Learner(copy.deepcopy(model), "p3o", {"log_ratio_clip": clip}, micro_batch_size=micro, lr=0.0)
        assert learner.step(copy.deepcopy(b))["ess"] == pytest.approx(want, rel=1e-9), micro


def _plain_logprobs(model, b):
    """log π_θ of the completion tokens from a plain transformers forward, log_softmax and gather (float64)."""
    p, c = b.packed, b.packed.response_mask.shape[1]
    with torch.no_grad():
        logits = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids).logits
    return torch.log_softmax(logits[:, -c - 1:-1].double(), -1).gather(-1, p.input_ids[:, -c:, None])[..., 0]


@pytest.mark.parametrize("objective", ["grpo", "cispo", "reinforce", "gspo"])
def test_every_objectives_logged_ess_is_the_steps_batch_ess(tiny, objective):
    """The objectives without a batch ESS of their own logged the token-weighted mean of their micro-batches' ESS
    (0.667 at one row per micro-batch where the batch's is 0.491); on several ranks likewise."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    m = b.packed.response_mask
    rho = (_plain_logprobs(model, b) - b.behavior_logprobs)[m].clamp(-20, 20).exp()
    want = float(rho.sum() ** 2 / (rho.numel() * (rho * rho).sum()))  # Eq. 11 over the whole batch
    assert want < 0.8
    for micro in (6, 2, 1):
        learner = Learner(copy.deepcopy(model), objective, micro_batch_size=micro, lr=0.0)
        assert learner.step(copy.deepcopy(b))["ess"] == pytest.approx(want, rel=1e-9), micro


@pytest.mark.parametrize("objective", ["p3o", "grpo"])
def test_ratio_quantiles_are_the_steps_whatever_the_micro_batches(tiny, objective):
    """ratio_p50/p99 were each objective call's quantiles, averaged: they moved with micro_batch_size and ran low in
    the tail (the reviewer's: p99 1.98 at three rows a micro-batch against 2.52 over the step). The reference:
    torch.quantile over the step's token ratios from a plain float64 forward."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    rho = (_plain_logprobs(model, b) - b.behavior_logprobs)[b.packed.response_mask].exp()
    want = [float(torch.quantile(rho, q)) for q in (0.5, 0.99)]
    for micro in (6, 2, 1):
        out = Learner(copy.deepcopy(model), objective, micro_batch_size=micro, lr=0.0).step(copy.deepcopy(b))
        # float32: the objectives take quantiles of float32 ratios
        assert [out["ratio_p50"], out["ratio_p99"]] == pytest.approx(want, rel=1e-6), micro


def test_sequence_scope_and_gspo_row_metrics_weight_rows_by_their_tokens_whatever_the_micro_batches(tiny):
    """P3O's ess and kl_weight in sequence scope, and GSPO's seq_ratio_mean, were means over each call's rows, which
    the learner then weighted by the call's tokens: they moved with micro_batch_size (0.714, 0.701, 0.667)."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    m = b.packed.response_mask
    lr = torch.where(m, _plain_logprobs(model, b) - b.behavior_logprobs, 0.0).clamp(-20, 20)
    n_i = m.sum(1).double()
    rho = lr.exp() * m
    e_i = rho.sum(1) ** 2 / (n_i * (rho * rho).sum(1)).clamp_min(1e-300)  # each row's normalized ESS
    s_i = (lr.sum(1) / n_i.clamp_min(1)).exp()  # GSPO's sequence ratio
    ess_want = float((e_i * n_i).sum() / n_i.sum())
    seq_want = float((s_i * n_i).sum() / n_i.sum())
    for micro in (6, 2, 1):
        p3o = Learner(copy.deepcopy(model), "p3o", {}, micro_batch_size=micro, lr=0.0, ess_scope="sequence")
        out = p3o.step(copy.deepcopy(b))
        assert (out["ess"], out["kl_weight"]) == (pytest.approx(ess_want, rel=1e-6),
                                                  pytest.approx(1 - ess_want, rel=1e-6)), micro
        gspo = Learner(copy.deepcopy(model), "gspo", {}, micro_batch_size=micro, lr=0.0)
        assert gspo.step(copy.deepcopy(b))["seq_ratio_mean"] == pytest.approx(seq_want, rel=1e-6), micro


def test_grpo_zeroed_share_is_logged_only_with_diagnostics(tiny):
    """GRPO's clip diagnostic runs only when asked (train.diagnostics): absent by default, and with it on, the share
    of valid tokens with A > 0 and ρ > 1 + ε or A < 0 and ρ < 1 − ε (ρ = π_θ/π_b), counted by hand over the batch."""
    from trustbatch.policy.forward import response_logprobs

    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    _, plain = _grads(model, b, micro=2)
    assert not [k for k in plain if k.startswith("grpo_zeroed")]
    learner = Learner(copy.deepcopy(model), "p3o", micro_batch_size=2, lr=0.0, diagnostics=True)
    got = learner.step(b)
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.packed)
    m = b.packed.response_mask
    rho = (logp - b.behavior_logprobs).exp()[m]
    adv = b.advantages[:, None].expand_as(m)[m]
    for eps in (0.2, 0.4):
        want = float((((adv > 0) & (rho > 1 + eps)) | ((adv < 0) & (rho < 1 - eps))).double().mean())
        assert got[f"grpo_zeroed_{eps}"] == pytest.approx(want, abs=1e-12), eps
    assert 0 < got["grpo_zeroed_0.2"]  # the batch is off-policy enough for the clip to zero some tokens
    assert {k: v for k, v in got.items() if not k.startswith("grpo_zeroed")}.keys() == plain.keys()


def test_stop_before_ends_train_on_before_that_optimizer_step(tiny):
    """The hook sees each step's mini-batch before the step; True there ends train_on without that step."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    learner = Learner(copy.deepcopy(model), "p3o", lr=1e-3, epochs=2, minibatches=2)
    seen = []

    def stop_before(opt_step, mini_batch):
        seen.append((opt_step, len(mini_batch)))
        return opt_step == 3

    out = learner.train_on(b, stop_before=stop_before)
    assert [s for s, _ in seen] == [0, 1, 2, 3] and sum(n for _, n in seen[:2]) == len(b)  # an epoch covers the batch
    assert learner.version == 3 and out["optimizer_steps"] == 3.0 and len(learner.step_records) == 3


def test_minibatches_split_the_rows_evenly_into_that_many_optimizer_steps(tiny):
    """6 rows in 4 mini-batches: 2 + 2 + 1 + 1 rows, four steps that each train (torch.chunk gave 2 + 2 + 2 and an
    empty fourth step, which moved the version and the schedule without a gradient)."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    assert len(b) == 6
    learner = Learner(copy.deepcopy(model), "p3o", lr=1e-3, minibatches=4)
    sizes = []
    learner.train_on(b, stop_before=lambda step, mini: sizes.append(len(mini)) or False)
    assert sizes == [2, 2, 1, 1]
    assert [r["grad_norm"] > 0 for r in learner.step_records] == [True] * 4 and learner.version == 4


def test_a_batch_of_fewer_rows_than_minibatches_takes_a_step_a_row_and_no_empty_step(tiny):
    """2 rows (what DAPO's dynamic sampling may keep) in 4 mini-batches: 2 steps of one row each, so the version,
    the schedule and the logged steps count only steps that trained (an empty step moved all three)."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    small = b.select(torch.arange(2))
    learner = Learner(copy.deepcopy(model), "grpo", lr=1e-3, minibatches=4, lr_schedule="linear", total_steps=8)
    sizes = []
    out = learner.train_on(small, stop_before=lambda step, mini: sizes.append(len(mini)) or False)
    assert sizes == [1, 1] and learner.version == 2 and out["optimizer_steps"] == 2.0
    assert learner.scheduler.last_epoch == 2 and [r["lr"] for r in learner.step_records] == [1e-3, 1e-3 * 7 / 8]


def test_the_logged_lr_is_the_rate_the_step_used(tiny):
    """Linear warm-up over 4 steps to lr = 1: the steps use 1/4, 2/4, 3/4, 1 (by hand), and log those."""
    tok, model = tiny
    b = _batch(tok, seed=3)
    b.behavior_logprobs = b.behavior_logprobs.double()
    learner = Learner(copy.deepcopy(model), "grpo", lr=1.0, warmup_steps=4, minibatches=5)
    used = []
    learner.train_on(b, stop_before=lambda step, mini: used.append(learner.optimizer.param_groups[0]["lr"]) or False)
    assert used[:4] == [0.25, 0.5, 0.75, 1.0]
    assert [r["lr"] for r in learner.step_records] == used
