"""Each behaviour shift of the lab, run in miniature, has the property that defines it."""

import json

import pytest
import torch

from trustbatch.config import load_config
from trustbatch.policy import load_policy
from trustbatch.policy.forward import pack, response_logprobs
from trustbatch.pipeline.source import sample_groups
from trustbatch.pipeline.weight_sync import WeightHistory
from trustbatch.recipes import train
from trustbatch.rollout import SamplingParams, TransformersEngine
from trustbatch.rollout.shifts import behaviour_copy

from tiny import TINY


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE", str(tmp_path / "cache"))


def _run(tmp_path, *extra, steps=3):
    run = tmp_path / "run"
    train(load_config(None, TINY + [f"train.steps={steps}", f"run_dir={run}", "eval.every=100", *extra]))
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if json.loads(l)["step"] > 0]


def _sampling(ro_cfg):
    return SamplingParams(temperature=ro_cfg.temperature, top_p=ro_cfg.top_p, max_new_tokens=ro_cfg.max_new_tokens)


def _full_forward_logprobs(model, rollouts, pad_id, temperature=1.0):
    packed = pack([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    with torch.no_grad():
        lp, _ = response_logprobs(model, packed, temperature=temperature)
    return lp, packed.response_mask


def _behaviour(rollouts, C):
    out = torch.zeros(len(rollouts), C)
    for i, r in enumerate(rollouts):
        out[i, C - len(r.behavior_logprobs):] = torch.tensor(r.behavior_logprobs)
    return out


@pytest.mark.parametrize("temperature", [0.6, 1.2])
def test_temperature_shift_records_log_softmax_of_logits_over_t(shared_dir, temperature):
    policy = load_policy(shared_dir / "models" / "stories260K-hf")
    ro_cfg = load_config(None, [f"rollout.temperature={temperature}", "rollout.group_size=4",
                                "rollout.max_new_tokens=10"]).rollout
    engine = TransformersEngine(policy.model, policy.eos_id, policy.pad_id)
    torch.manual_seed(0)
    ro = sample_groups(engine, None, [policy.encode_prompt(t) for t in ("Once upon a time", "The cat")],
                       ro_cfg.group_size, 0.0, _sampling(ro_cfg))
    lp_t, mask = _full_forward_logprobs(policy.model, ro, policy.pad_id, temperature)
    lp_1, _ = _full_forward_logprobs(policy.model, ro, policy.pad_id, 1.0)
    beh = _behaviour(ro, mask.shape[1])
    assert torch.allclose(beh[mask], lp_t[mask], atol=1e-4)
    assert (beh[mask] - lp_1[mask]).abs().max() > 1e-2  # the learner's T = 1 log-probs differ: a real shift


def test_no_shift_in_float32_gives_ess_one_at_the_first_step(tmp_path, cache):
    first = _run(tmp_path, steps=1)[0]
    assert abs(first["ess"] - 1.0) < 1e-6
    assert first["behaviour_version"] == 0 and first["staleness"] == 0


@pytest.mark.parametrize("precision", ["bfloat16", "float16", "int8"])
def test_precision_shift_gives_ess_below_one(tmp_path, cache, precision):
    first = _run(tmp_path, f"rollout.precision={precision}", "rollout.max_new_tokens=6", steps=1)[0]
    assert first["ess"] < 1.0, first["ess"]  # bf16 ≈ 1 − 1e-6, fp16 ≈ 1 − 2e-8 on this tiny model
    assert first["kl_behavior"] > 0


def test_precision_copy_is_in_that_precision_and_close_to_the_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    x = torch.randint(0, 50, (2, 7))
    ref = model(x).logits
    for precision, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        m = behaviour_copy(model, precision)
        assert m.model.embed_tokens.weight.dtype == dtype
        diff = (m(x).logits.float() - ref).abs().max()
        assert 0 < diff < 0.1
    q = behaviour_copy(model, "int8")
    assert "Quantized" in type(q.model.layers[0].mlp.up_proj).__name__ or "quantized" in type(q.model.layers[0].mlp.up_proj).__module__
    assert 0 < (q(x).logits - ref).abs().max() < 0.5
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the policy itself is untouched


@pytest.mark.parametrize("k", [1, 2, 4])
def test_staleness_k_samples_from_policy_version_t_minus_k(tmp_path, cache, k):
    recs = _run(tmp_path, f"rollout.staleness={k}", steps=6)
    for step, r in enumerate(recs, start=1):
        t = step - 1  # policy version (optimizer steps) when round `step` samples
        assert r["behaviour_version"] == max(0, t - k), (step, r["behaviour_version"])
        assert r["staleness"] == min(t, k)
        assert r["policy_version"] == step


def test_weight_history_serves_the_weights_of_that_version():
    model = torch.nn.Linear(2, 2)
    hist = WeightHistory(keep=2)
    for v in range(5):
        with torch.no_grad():
            model.weight.fill_(float(v))
        hist.record(v, model)
    v, state = hist.at_or_before(3)
    assert v == 3 and torch.all(state["weight"] == 3.0)
    v, state = hist.at_or_before(0)  # older than kept: the oldest kept snapshot (keep + 1 = 3 of them)
    assert v == 2 and torch.all(state["weight"] == 2.0)


def test_foreign_fraction_samples_part_of_each_group_from_the_other_model(shared_dir):
    policy = load_policy(shared_dir / "models" / "stories260K-hf")
    other = load_policy(shared_dir / "models" / "stories260K-hf").model
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))  # another checkpoint, same tokenizer
    ro_cfg = load_config(None, ["rollout.group_size=4", "rollout.foreign_fraction=0.5", "rollout.max_new_tokens=8"]).rollout
    own = TransformersEngine(policy.model, policy.eos_id, policy.pad_id)
    foreign = TransformersEngine(other, policy.eos_id, policy.pad_id)
    torch.manual_seed(0)
    ro = sample_groups(own, foreign, [policy.encode_prompt(t) for t in ("Once upon a time", "Tom")],
                       ro_cfg.group_size, ro_cfg.foreign_fraction, _sampling(ro_cfg))
    assert [r.prompt_index for r in ro] == [0, 0, 0, 0, 1, 1, 1, 1]
    lp_pol, mask = _full_forward_logprobs(policy.model, ro, policy.pad_id)
    lp_for, _ = _full_forward_logprobs(other, ro, policy.pad_id)
    beh = _behaviour(ro, mask.shape[1])
    for i in range(len(ro)):
        from_foreign = i % 4 >= 2
        m = mask[i]
        expect, alt = (lp_for, lp_pol) if from_foreign else (lp_pol, lp_for)
        assert torch.allclose(beh[i][m], expect[i][m], atol=1e-4), i
        assert (beh[i][m] - alt[i][m]).abs().max() > 1e-3, i


def test_foreign_run_and_replay_run(tmp_path, cache):
    recs = _run(tmp_path, "rollout.foreign_fraction=0.5", "train.epochs=2", "train.minibatches=2", steps=2)
    assert [r["optimizer_steps"] for r in recs] == [4, 4]
    assert [r["policy_version"] for r in recs] == [4, 8]
    assert all(r["foreign_fraction"] == 0.5 for r in recs)
    assert recs[1]["ess"] < 1.0  # the foreign half (the frozen initial policy) and replay are off-policy


def test_a_run_that_builds_its_foreign_model_trains_as_one_that_finds_it_cached(tmp_path, cache):
    """The foreign model's base is built after the run seeded itself, and its build reseeded torch's generator: the
    mini-batch permutations then came from the foreign model's seed, so the first run of a command trained another
    model than the same command once the base was cached (round 1's kl_behavior 0.527 against 0.032, a reviewer's
    run). Reference: the second run, whose foreign model comes from the cache."""
    from runproc import TIMING

    foreign = ["rollout.foreign_fraction=0.5", "rollout.foreign_model={hidden: 24, layers: 1, seed: 3}",
               "train.minibatches=2", "train.lr=1e-2"]
    runs = []
    for name in ("builds", "cached"):
        run = tmp_path / name
        train(load_config(None, TINY + ["train.steps=2", f"run_dir={run}", "eval.every=100", *foreign]))
        runs.append([{k: v for k, v in json.loads(l).items() if k not in TIMING}
                     for l in (run / "metrics.jsonl").read_text().splitlines()])
    assert len(list((tmp_path / "cache" / "base").iterdir())) == 2  # the policy's base and the foreign one
    assert runs[0] == runs[1]


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_half_precision_rollout_copy_is_transformers_own_model_of_that_dtype(precision):
    """The copy's ``Module.to`` rounded RoPE's frequency table to bf16 too: at position ~2,000 a rotation angle was
    off by about 1 rad (Qwen2.5-0.5B's rope_theta 1e6, head_dim 64), so the lab's bf16 shift measured a RoPE
    artefact that grew with the position. Reference: transformers' own model of that dtype (``from_config(dtype=)``)
    with the same weights, whose logits the copy's now equal bit for bit."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trustbatch.rollout.shifts import behaviour_copy

    cfg = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, rope_theta=1e6, max_position_embeddings=4096)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(cfg).eval()
    ref = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, precision)).eval()
    ref.load_state_dict(policy.state_dict())
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        for start in (0, 2000, 3900):
            pos = torch.arange(start, start + 8)[None]
            ours = behaviour_copy(policy, precision)(ids, position_ids=pos).logits
            assert torch.equal(ours, ref(ids, position_ids=pos).logits), start
