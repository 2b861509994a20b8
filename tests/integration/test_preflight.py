"""``trustbatch lab preflight``: GRPO's zeroed share against a hand count, the P3O–GRPO gradient cosine against
float64 autograd of both objectives written out by hand, and the command end to end on a tiny experiment."""

import copy
import json
import math
import time

import pytest
import torch
import yaml
from typer.testing import CliRunner

from trustbatch.cli import app

from trustbatch.lab.preflight import is_control, learner_gradient, probe_batch
from trustbatch.pipeline.batch import TrainBatch
from trustbatch.policy.forward import pack, response_logprobs

from tiny import TINY


def _tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _packed(rows):
    """``rows``: (prompt ids, completion ids) pairs with token ids in 1..22 (0 pads)."""
    return pack([p for p, _ in rows], [c for _, c in rows], pad_id=0)


def test_zeroed_share_is_the_hand_count_of_inactive_clipped_tokens():
    model = _tiny_model()
    packed = _packed([([1, 2, 3], [4, 5, 6, 7]), ([8, 9], [10, 11, 12, 13]), ([14], [15, 16, 17, 18])])
    with torch.no_grad():
        logp, _ = response_logprobs(model, packed)
    # ratios ρ = π_θ/π_b set per token by choosing log π_b = log π_θ − log ρ
    rho = torch.tensor([[1.50, 1.30, 1.10, 0.70],    # A > 0: 1.5 and 1.3 above 1.2 → 2 zeroed at ε=0.2; 1.5 at ε=0.4
                        [0.50, 0.70, 0.90, 1.50],    # A < 0: 0.5 and 0.7 below 0.8 → 2 at ε=0.2; 0.5 at ε=0.4
                        [0.10, 3.00, 1.00, 1.00]])   # A = 0: never zeroed
    adv = torch.tensor([1.0, -1.0, 0.0])
    batch = TrainBatch(packed, logp - rho.log(), adv)
    res = probe_batch(model, batch)
    assert res["tokens"] == 12
    assert res["zeroed"][0.2] == pytest.approx(4 / 12, abs=1e-6)  # float32 metric; one token off is 0.083
    assert res["zeroed"][0.4] == pytest.approx(2 / 12, abs=1e-6)
    assert res["informative"] == pytest.approx(8 / 12, abs=1e-12)


def _reference_gradients(model, batch, eps_list):
    """Both objectives written out from their definitions, in float64, with their own forward pass.

    P3O (arXiv 2605.12380 Eq. 11–12): e = (Σρ)²/(N Σρ²), ℓ_t = −sg(min(ρ_t, e))·A·log π_θ + (1 − e)·k3_t,
    k3 = π_b/π_θ − 1 − log(π_b/π_θ). GRPO (arXiv 2402.03300 Eq. 3): ℓ_t = −min(ρ·A, clip(ρ, 1 ± ε)·A).
    Both token means over the N valid tokens.
    """
    m64 = copy.deepcopy(model).double()
    params = list(m64.parameters())
    p = batch.packed
    B, C = p.response_mask.shape
    logits = m64(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids).logits
    L = p.input_ids.shape[1]
    logp = torch.zeros(B, C, dtype=torch.float64)
    for i in range(B):
        for t in range(C):
            pos = L - C + t  # the token at pos is predicted by the logits at pos - 1
            logp[i, t] = torch.log_softmax(logits[i, pos - 1], -1)[p.input_ids[i, pos]]
    mask = p.response_mask
    blp = batch.behavior_logprobs.double()
    A = batch.advantages.double()[:, None].expand(B, C)
    n = mask.sum()
    rho = (logp - blp).exp()
    rd = rho.detach()[mask]
    e = rd.sum() ** 2 / (n * (rd * rd).sum())

    def flat(loss):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])

    r_b = (blp - logp).exp()
    p3o_t = -torch.minimum(rho.detach(), e) * A * logp + (1 - e) * (r_b - 1 - (blp - logp))
    out = {"p3o": flat(p3o_t[mask].sum() / n), "ess": float(e)}
    for eps in eps_list:
        grpo_t = -torch.minimum(rho * A, rho.clamp(1 - eps, 1 + eps) * A)
        out[eps] = flat(grpo_t[mask].sum() / n)
    return out


@pytest.mark.parametrize("scale", [0.0, 0.4])
def test_cosine_matches_float64_autograd_of_both_objectives(scale):
    model = _tiny_model(1)
    g = torch.Generator().manual_seed(2)
    rows = [([int(x) for x in torch.randint(1, 23, (3,), generator=g)],
             [int(x) for x in torch.randint(1, 23, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)])
            for _ in range(8)]
    packed = _packed(rows)
    with torch.no_grad():
        logp, _ = response_logprobs(model, packed)
    blp = logp + scale * torch.randn(logp.shape, generator=g)  # scale 0: on-policy, ρ ≡ 1
    adv = torch.randn(8, generator=g)
    batch = TrainBatch(packed, blp, adv)
    ref = _reference_gradients(model, batch, (0.2, 0.4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = probe_batch(model, batch, micro_batch_size=3)  # micro-batches: the learner's batch ESS and token mean
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing was applied
    assert res["ess"] == pytest.approx(ref["ess"], abs=1e-6)
    for eps in (0.2, 0.4):
        cos_ref = float(ref["p3o"] @ ref[eps] / (ref["p3o"].norm() * ref[eps].norm()))
        assert res["cosine"][eps] == pytest.approx(cos_ref, abs=1e-5)
    g_p3o, _ = learner_gradient(model, batch, "p3o", micro_batch_size=3)
    assert torch.allclose(g_p3o, ref["p3o"], rtol=1e-4, atol=1e-6 * float(ref["p3o"].abs().max()))
    if scale == 0.0:  # on-policy: both are −(1/N) Σ A ∇log π, the same vector (π_b is float32 round-off from π_θ)
        assert torch.allclose(ref["p3o"], ref[0.2], rtol=1e-5, atol=1e-7 * float(ref["p3o"].abs().max()))
        assert ref["ess"] == pytest.approx(1, abs=1e-10)
        assert all(abs(res["cosine"][e] - 1) < 1e-6 for e in (0.2, 0.4))
    else:  # the shift must be strong enough for this test to tell a wrong cosine from 1
        assert cos_ref < 0.99 and res["zeroed"][0.2] > 0


def test_control_rule():
    assert is_control({0.2: 0.995, 0.4: 0.999}, {0.2: 0.005, 0.4: 0.0})
    assert not is_control({0.2: 0.98, 0.4: 0.999}, {0.2: 0.005, 0.4: 0.0})
    assert not is_control({0.2: 0.995, 0.4: 0.999}, {0.2: 0.02, 0.4: 0.0})
    assert not is_control({0.2: math.nan, 0.4: 0.999}, {0.2: 0.0, 0.4: 0.0})


def test_cli_prints_the_table_and_writes_the_json(tmp_path, monkeypatch):
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    common.update({"threads": 1, "rollout.prompts_per_step": 8})
    spec = {"description": "tiny", "common": common, "seeds": [0, 1],
            "arms": {"onpolicy": {}, "p3o@T0.5": {"objective.name": "p3o", "rollout.temperature": 0.5},
                     "p3o@k2": {"objective.name": "p3o", "rollout.staleness": 2},
                     # the learner at the sampling temperature too (as TRL and verl score): on-policy again
                     "p3o@T0.5-learnerT": {"objective.name": "p3o", "rollout.temperature": 0.5,
                                           "objective.temperature": "rollout"}}}
    f = tmp_path / "tiny_pf.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    before = time.time()
    r = CliRunner().invoke(app, ["lab", "preflight", str(f), "--out", str(tmp_path / "out")])
    after = time.time()
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "out" / "tiny_pf" / "preflight.json").read_text())
    # its own time, base build included, for the report's cost table (issue 47: the pre-flight is a cost)
    assert before <= res["start"] < res["end"] <= after and res["commit"]
    assert res["seeds"] == [0] and [a["arm"] for a in res["arms"]] == ["onpolicy", "p3o@T0.5", "p3o@k2",
                                                                       "p3o@T0.5-learnerT"]
    on = next(p for p in res["probes"] if p["arm"] == "onpolicy")
    # no shift: P3O's gradient is the plain policy gradient, and so is GRPO's at ρ = 1
    assert on["informative"] > 0  # otherwise both gradients are 0 and the cosine says nothing
    assert abs(on["ess"] - 1) < 1e-6 and abs(on["cos@0.2"] - 1) < 1e-6 and abs(on["cos@0.4"] - 1) < 1e-6
    assert on["zeroed@0.2"] == 0 and on["verdict"] == "control"
    cold = next(p for p in res["probes"] if p["arm"] == "p3o@T0.5")
    assert cold["ess"] < 0.99 and cold["zeroed@0.2"] > 0 and cold["verdict"] == "test"
    assert next(p for p in res["probes"] if p["arm"] == "p3o@k2")["age"] == 2  # the lag, read from the tags
    warm = next(p for p in res["probes"] if p["arm"] == "p3o@T0.5-learnerT")  # it was probed at T = 1: "test"
    assert abs(warm["ess"] - 1) < 1e-6 and warm["zeroed@0.2"] == 0 and warm["verdict"] == "control"
    assert warm["shift"] == "none"
    for arm in ("onpolicy", "p3o@T0.5", "p3o@k2", "control", "test", "T=0.5", "lag 2"):
        assert arm in r.output


def test_report_opens_with_every_preflight_including_preflight_only_folders(tmp_path):
    """The report's first table (issue 14, item 1): every experiment's pre-flight rows, with the folders that
    hold only a pre-flight (a dose ladder never run in full) and the arms an experiment left out."""
    import json

    import yaml

    from trustbatch.lab.report import preflight_summary

    def row(arm, ess, z2, cos2, verdict):
        return {"arm": arm, "shift": "x", "age": 0, "ess": ess, "zeroed@0.2": z2, "zeroed@0.4": 0.0,
                "cos@0.2": cos2, "cos@0.4": 0.999, "verdict": verdict}

    (tmp_path / "doses").mkdir()
    (tmp_path / "doses" / "preflight.json").write_text(json.dumps({"arms": [row("p3o@bf16", 0.99991, 0.001, 0.9993, "control")]}))
    (tmp_path / "temp").mkdir()
    (tmp_path / "temp" / "experiment.yaml").write_text(yaml.safe_dump({"arms": {"p3o@T0.6": {}, "p3o@T0.9": {}},
                                                                        "preflight_only": ["p3o@T0.9"]}))
    (tmp_path / "temp" / "preflight.json").write_text(json.dumps({"arms": [row("p3o@T0.6", 0.8045, 0.075, 0.862, "test"),
                                                                          row("p3o@T0.9", 0.97, 0.02, 0.97, "test")]}))
    (tmp_path / "nopre").mkdir()
    (tmp_path / "nopre" / "experiment.yaml").write_text("arms: {a: {}}\n")
    lines = preflight_summary(tmp_path)
    assert lines[0] == "## Pre-flight: which arms are tests"
    body = [x for x in lines if x.startswith("| ") and not x.startswith("| experiment")]
    assert body == [
        "| doses | p3o@bf16 | 0 | 0.9999 | 0.1% | 0.0% | 0.999 | 0.999 | control | no full run |",
        "| temp | p3o@T0.6 | 0 | 0.8045 | 7.5% | 0.0% | 0.862 | 0.999 | test | yes |",
        "| temp | p3o@T0.9 | 0 | 0.9700 | 2.0% | 0.0% | 0.970 | 0.999 | test | no (pre-flight only) |",
    ]
    assert "cos > 0.99 and zeroed < 1%" in "\n".join(lines)
    assert preflight_summary(tmp_path / "nopre") == []
