"""``train.padding_free`` with the exact KL: the packed learner's P3O loss, ESS, KL and gradients equal the padded one's.

Reference: the padded learner (``forward.teacher_forced`` and ``response_logprobs``, which tests/unit/
test_exact_kl_rebuilt.py checks against a float64 brute force) on the same batch and weights. Float64 models with
float64 RMSNorm (tests/support/llama_rows.py) under sdpa, so the two may differ only by float64 round-off: 1e-10
relative. The packed learner teacher-forces the behaviour (and proximal) models through its own packed layout
(``packed.packed_teacher_forced``) and reads the reference at the packed positions (``TeacherForced.at``); the cases
cover one behaviour model, the learner's own replayed (its frozen copy), the two-anchor mixture, and a batch whose
rows mix two teachers, a recorded distribution and top-k log-probs (parts by rows, regrouped by position).
"""


import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.chunked_logprobs import TeacherForced
from trustbatch.policy.forward import Recorded, Teacher, TopK, pack, teacher_forced
from trustbatch.policy.packed import packed_teacher_forced
from trustbatch.trainer.learner import Learner

from grad_probe import sgd_recording_grads
from llama_rows import _close, _llama, _rows, full64, perturbed

TOL = 1e-10
K = 5  # top-k rows' k


def _batch(model, case: str) -> TrainBatch:
    """The rows of ``_rows`` with behaviour log-probs of their behaviour, random advantages, and their behaviour
    models (``mixed``: versions 0-3 by row, a tempered teacher, an untempered one, recorded, top-k)."""
    packed = pack(*_rows(seed=6), pad_id=0)
    B, C = packed.response_mask.shape
    tgt = packed.input_ids[:, -C:, None]
    adv = torch.randn(B, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if case == "mixed":
        version = torch.arange(B) % 4
        teachers = {0: Teacher(perturbed(model, 1), 0.7), 1: Teacher(perturbed(model, 2), 1.0)}
        with torch.no_grad():
            lq = {v: full64(t.model, packed, t.temperature) for v, t in teachers.items()}
            lq[2], lq[3] = full64(perturbed(model, 3), packed), full64(perturbed(model, 4), packed)
        rows_of = {v: version == v for v in range(4)}
        blp = sum(torch.where(rows_of[v][:, None], lq[v].gather(-1, tgt)[..., 0], 0.0) for v in range(4))
        top_lp, top_ids = lq[3].topk(K, -1)
        return TrainBatch(packed, torch.where(packed.response_mask, blp, 0.0), adv, version,
                          behaviour={**teachers, 2: Recorded(), 3: TopK(K)},
                          behavior_logprobs_full=torch.where(rows_of[2][:, None, None], lq[2], 0.0),
                          behavior_top_logprobs=torch.where(rows_of[3][:, None, None], top_lp, 0.0),
                          behavior_top_ids=torch.where(rows_of[3][:, None, None], top_ids, 0))
    behaviour = Teacher(model, 1.0) if "own" in case else Teacher(perturbed(model, 1), 0.7)
    with torch.no_grad():
        blp = full64(behaviour.model, packed, behaviour.temperature).gather(-1, tgt)[..., 0]
    return TrainBatch(packed, torch.where(packed.response_mask, blp, 0.0), adv, behaviour={0: behaviour})


def _train(case: str, padding_free: bool, chunk_size, share: bool):
    """(per-step gradients, per-step records, the behaviour model's forwards' input sizes for ``p3o-other``) of a
    learner with kl=exact on ``case``'s batch."""
    model = _llama()
    batch = _batch(model, case)
    objective = "p3o_two_anchor" if case.startswith("two") else "p3o"
    learner = Learner(model, objective, {"kl": "exact"}, micro_batch_size=6, logprob_chunk_size=chunk_size,
                      minibatches=2 if "replayed" in case else 1, padding_free=padding_free, shared_prompt=share)
    learner.grad_clip = 1e9
    steps = []
    sgd_recording_grads(learner, model, steps)
    seen = []  # the behaviour model's forwards: their input positions
    if case == "p3o-other":
        inner = batch.behaviour[0].model.model.embed_tokens
        inner.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    torch.manual_seed(5)
    learner.train_on(batch)
    return [g for _, g in steps], learner.step_records, seen


@pytest.mark.parametrize("chunk_size,share", [(2, True), (None, False)], ids=["chunked-shared", "full-plain"])
@pytest.mark.parametrize("case", ["p3o-other", "p3o-own-replayed", "two_anchor-replayed", "mixed"])
def test_packed_exact_kl_loss_and_gradients_equal_padded(case, chunk_size, share):
    (want_g, want_r, want_seen), (got_g, got_r, got_seen) = (_train(case, pf, chunk_size, share) for pf in (False, True))
    # the packed learner teacher-forces the behaviour model packed: fewer positions than each padded micro-batch
    assert len(got_seen) == len(want_seen) and all(g < w for g, w in zip(got_seen, want_seen))
    assert bool(want_seen) == (case == "p3o-other")
    assert len(got_g) == len(want_g) == (2 if "replayed" in case else 1)
    for k, (want, got) in enumerate(zip(want_g, got_g)):
        for name in want:
            _close(got[name], want[name], f"{case} step {k} grad {name}", TOL)
        assert max(float(g.abs().max()) for g in want.values()) > 1e-3
    bound = "kl_behavior_bound" if case == "mixed" else "kl_behavior"  # top-k rows: the KL is their lower bound
    for want, got in zip(want_r, got_r):
        for key in ("loss", "ess", bound, "entropy"):
            assert got[key] == pytest.approx(want[key], rel=TOL, abs=1e-14), key  # own rows, first step: KL 0 up to round-off
    assert want_r[-1][bound] > 1e-3  # the KL term carried weight


def test_packed_teacher_forced_equals_padded_at_every_valid_position():
    """The packed teacher's distribution equals the padded one's at every valid position, rows split between two
    teachers (one tempered), read back through ``TeacherForced.at`` as the packed learner reads it."""
    model = _llama()
    packed = pack(*_rows(seed=7), pad_id=0)
    m = packed.response_mask
    rows = [torch.arange(0, len(m), 2), torch.arange(1, len(m), 2)]
    teachers = [(rows[0], Teacher(perturbed(model, 1), 0.7)), (rows[1], Teacher(model, 1.0))]
    padded = teacher_forced(packed, teachers).log_probs(slice(None), torch.float64)
    got = packed_teacher_forced(packed, teachers, min_saving=0.0)
    _close(got.log_probs(slice(None), torch.float64)[m], padded[m], "rebuilt log-probs", TOL)
    flat = got.at(m)
    assert flat.shape == (1, int(m.sum()))
    M = flat.shape[1]
    for cols in (slice(0, M), slice(3, 11), slice(M - 2, M)):
        _close(flat.log_probs(cols, torch.float64)[0], padded[m][cols], f"positions {cols}", TOL)
    assert isinstance(got, TeacherForced) and float(padded[m].exp().sum(-1).sub(1).abs().max()) < 1e-12
    # the teacher ran packed: fewer positions than the padded layout's (one forward per teacher)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    packed_teacher_forced(packed, [(None, Teacher(model))])
    hook.remove()
    assert len(seen) == 1 and seen[0] < packed.input_ids.numel()


def test_a_teacher_whose_head_cannot_be_split_teaches_packed_as_padded():
    """A foreign behaviour model of another architecture (GPT-2: its head is no plain split of the learner's kind)
    keeps its logits at the predicting positions only; they equal the padded teacher's at every valid position."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=_llama().config.vocab_size, n_embd=16, n_layer=1, n_head=2,
                                      n_positions=128)).double().eval()
    packed = pack(*_rows(seed=7), pad_id=0)
    m = packed.response_mask
    padded = teacher_forced(packed, [(None, Teacher(gpt2, 0.8))]).log_probs(slice(None), torch.float64)
    got = packed_teacher_forced(packed, [(None, Teacher(gpt2, 0.8))], min_saving=0.0)
    _close(got.log_probs(slice(None), torch.float64)[m], padded[m], "a GPT-2 teacher's log-probs", TOL)
