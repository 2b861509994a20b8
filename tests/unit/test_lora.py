"""LoRA through peft (model.lora): only the adapters train, engines get W + (α/r)·B·A, checkpoints hold the adapter.

Independent references: the merged weight written out from the layer's own tensors (W + (alpha/r) * B @ A),
peft's ``merge_and_unload`` on a copy, the base model's tensors saved before the run, and an uninterrupted run.
"""

import copy
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from trustbatch.config import load_config
from trustbatch.errors import UserError
from trustbatch.pipeline.weight_sync import named_weights
from trustbatch.policy import Policy, load_policy
from trustbatch.policy.lora import apply_lora, merged_copy, save_adapter
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.recipes import prepare_run, train
from trustbatch.recipes.build import build_parts
from trustbatch.rollout import TransformersEngine

from runproc import cache, records  # noqa: F401
from tiny import TINY

LORA = ["model.lora.r=4", "model.lora.alpha=8", "reward.workers=0"]


def _perturb_b(model, seed=1, scale=0.02):
    """peft starts B at 0 (the policy is the base); a nonzero B makes a missing merge visible. Small, so that
    the tiny base still solves a prompt now and then (scale 0.1 leaves every reward 0, every advantage 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture
def tiny_policy(tmp_path):
    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3", "State the answer"], vocab_size=300)
    model = build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=32, seed=0, tokenizer=tok)
    policy = Policy(model, tok, tok.eos_token_id, tok.pad_token_id)
    base = tmp_path / "base"
    policy.save(base)
    return load_policy(base), base


@pytest.mark.parametrize("targets,alpha", [("all-linear", 8.0), (["q_proj", "v_proj"], 6.0)])
def test_engines_receive_w_plus_scaled_ba_under_the_base_names(tiny_policy, tmp_path, targets, alpha):
    policy, base_dir = tiny_policy
    base = {k: v.clone() for k, v in policy.model.state_dict().items()}
    apply_lora(policy, r=4, alpha=alpha, dropout=0.0, target_modules=targets, base=str(base_dir))
    _perturb_b(policy.model)
    params = dict(policy.model.named_parameters())
    sent = dict(named_weights(policy.model))  # what CopySync / LaggedSync / async workers / vLLM receive
    assert sorted(sent) == sorted(base)  # no base_model. prefix, no lora_A/B keys, no base_layer
    adapted = {k for k in base if any(f".{t}." in k for t in (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj", "down_proj"]
                                                                  if targets == "all-linear" else targets))}
    assert len(adapted) == (7 if targets == "all-linear" else 2)
    for k in base:
        if k in adapted:
            stem = k.removesuffix(".weight")
            A, B = params[f"{stem}.lora_A.default.weight"], params[f"{stem}.lora_B.default.weight"]
            want = base[k] + (alpha / 4) * (B @ A)
            assert not torch.equal(want, base[k])
            torch.testing.assert_close(sent[k], want, rtol=0, atol=1e-6)
        else:
            assert torch.equal(sent[k], base[k]), k
    peft_merged = copy.deepcopy(policy.adapter).merge_and_unload().state_dict()
    assert sorted(peft_merged) == sorted(sent)
    for k in sent:
        torch.testing.assert_close(sent[k], peft_merged[k], rtol=0, atol=1e-6)
    # an engine holding its own plain copy loads them strictly, and an export (Policy.save) is the merged model
    engine = TransformersEngine(merged_copy(policy.model), policy.eos_id, policy.pad_id, share=False)
    engine.load_weights(named_weights(policy.model), 1)
    policy.save(tmp_path / "export")
    exported = load_policy(tmp_path / "export").model.state_dict()
    assert all(torch.equal(exported[k], sent[k]) for k in sent)
    # a checkpoint holds the adapter and names the base; loading it merges onto that base
    save_adapter(policy, tmp_path / "ckpt")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    reloaded = load_policy(tmp_path / "ckpt").model.state_dict()
    assert sorted(reloaded) == sorted(sent) and all(torch.equal(reloaded[k], sent[k]) for k in sent)


def test_target_modules_that_match_nothing_are_one_user_error(tiny_policy):
    policy, base_dir = tiny_policy
    with pytest.raises(UserError, match="target_modules"):
        apply_lora(policy, r=4, alpha=8, dropout=0.0, target_modules=["no_such_proj"], base=str(base_dir))


def test_an_output_layer_tied_to_the_embedding_is_refused(shared_dir):
    """stories260K ties lm_head to the input embedding: a merged copy loaded W + ΔW into both (one Parameter), so
    rollout engines and the export embedded inputs with the adapter's delta (2.3 nats off the peft policy)."""
    path = shared_dir / "models" / "stories260K-hf"
    assert json.loads((path / "config.json").read_text()).get("tie_word_embeddings", True)  # transformers' default
    with pytest.raises(UserError, match=r"adapts lm_head, whose weight is also model.embed_tokens.weight"):
        apply_lora(load_policy(path), r=4, alpha=8, dropout=0.0, target_modules=["lm_head"], base=str(path))
    apply_lora(load_policy(path), r=4, alpha=8, dropout=0.0, target_modules="all-linear", base=str(path))


def test_an_untied_output_layer_is_refused_it_would_take_the_full_head_path(tiny_policy):
    """LoRA on an untied lm_head made it a peft layer, which the chunked LM head does not take: the learner silently
    built every [B, C, V] logit (the reviewer's: 520 positions, 301 MiB where the budget is 441 and 256 MiB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    policy, base = tiny_policy
    untied = LlamaForCausalLM(LlamaConfig(vocab_size=len(policy.tokenizer), hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=False))
    untied_policy = Policy(untied, policy.tokenizer, policy.eos_id, policy.pad_id)
    with pytest.raises(UserError, match=r"adapts the output layer lm_head, which the learner's chunked LM head"):
        apply_lora(untied_policy, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "lm_head"], base=str(base))
    apply_lora(Policy(LlamaForCausalLM(untied.config), policy.tokenizer, policy.eos_id, policy.pad_id), r=4, alpha=8,
               dropout=0.0, target_modules="all-linear", base=str(base))  # all-linear leaves the output layer out


def _lora_run(extra=()):
    cfg = load_config(None, TINY + LORA + list(extra))
    task, policy, pool, _ = prepare_run(cfg)
    _perturb_b(policy.model)
    return cfg, task, policy, pool


@pytest.mark.parametrize("extra", [[], ["rollout.staleness=1"]], ids=["shared_module", "merged_copy_lagged"])
def test_on_policy_ess_is_one_with_a_nonzero_adapter(cache, extra):
    """The engine samples from the policy being trained: the shared module (W x + (α/r)·B A x) or a plain copy
    loaded with the merged weights (LaggedSync: lag 1 serves the current policy in round 1)."""
    cfg, task, policy, pool = _lora_run(extra)
    parts = build_parts(cfg, task, policy, pool).parts
    learner = parts.learner
    try:
        assert (parts.source.engine.model is policy.model) == (not extra)
        batch = parts.source.next_batch(learner.version)
        mask = batch.packed.response_mask
        with policy.adapter.disable_adapter():  # the base alone: the test fails if the engine lacked B·A
            base_logp = learner.logprobs(batch)
        assert float((base_logp - batch.behavior_logprobs)[mask].abs().max()) > 1e-2
        m = learner.train_on(batch)
        assert abs(m["ess"] - 1.0) < 1e-6, m["ess"]
        if not extra:  # after an optimizer step and a push, the next round is on-policy again
            parts.sync.push(learner.model, learner.version)
            m2 = learner.train_on(parts.source.next_batch(learner.version))
            assert abs(m2["ess"] - 1.0) < 1e-6, m2["ess"]
    finally:
        parts.source.close()
        pool.close()


def test_training_moves_only_the_adapters(cache):
    cfg, task, policy, pool = _lora_run(["rollout.prompts_per_step=16"])
    try:
        before = {k: v.clone() for k, v in policy.model.state_dict().items()}
        parts = build_parts(cfg, task, policy, pool).parts
        optimized = {id(p) for g in parts.learner.optimizer.param_groups for p in g["params"]}
        named = dict(policy.model.named_parameters())
        assert optimized == {id(p) for n, p in named.items() if "lora_" in n}
        for _ in range(2):
            batch = parts.source.next_batch(parts.learner.version)
            assert batch.advantages.abs().sum() > 0  # else nothing could move
            parts.learner.train_on(batch)
            parts.sync.push(parts.learner.model, parts.learner.version)
        after = policy.model.state_dict()
        for k in before:
            if "lora_" in k:
                assert not torch.equal(before[k], after[k]), k
            else:
                assert torch.equal(before[k], after[k]), k
    finally:
        pool.close()


def _adapter(ckpt):
    from safetensors.torch import load_file

    return load_file(str(ckpt / "adapter_model.safetensors"))


def test_resume_restores_the_adapter_and_optimizer_exactly(tmp_path, cache):
    quiet = Console(file=io.StringIO())
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = TINY + LORA + ["train.steps=4"]
    train(load_config(None, args + [f"run_dir={ref}"]), console=quiet)
    train(load_config(None, args + [f"run_dir={run}", "train.steps=2"]), console=quiet)
    train(resume=str(run), overrides=["train.steps=4"], console=quiet)
    a, b = ref / "checkpoints" / "step_000004", run / "checkpoints" / "step_000004"
    assert not (a / "model.safetensors").exists()
    wa, wb = _adapter(a), _adapter(b)
    assert sorted(wa) == sorted(wb) and wa and all("lora_" in k for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    w0 = _adapter(run / "checkpoints" / "step_000002")
    assert not all(torch.equal(wa[k], w0[k]) for k in wa)  # rounds 3-4 trained the adapter
    sa, sb = (torch.load(c / "trainer_state.pt", weights_only=False)["learner"]["optimizer"]["state"] for c in (a, b))
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in ("exp_avg", "exp_avg_sq"))
    assert records(run) == records(ref)
    base = json.loads((a / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (cache / "base") in Path(base).parents


def test_a_lora_run_trains_on_the_full_fine_tuning_base():
    """The adapters sit on top of the base: model.lora does not enter the default base's cache key."""
    from trustbatch.policy.base import base_key
    from trustbatch.recipes.build import task_key

    full, lora = (load_config(None, TINY + extra) for extra in ([], ["model.lora.r=8"]))
    assert full.model.model_dump(mode="json") != lora.model.model_dump(mode="json")
    assert base_key(task_key(lora), lora.model.model_dump(mode="json")) == \
        base_key(task_key(full), full.model.model_dump(mode="json"))


def test_the_reference_is_the_base_with_the_adapters_disabled_and_no_copy(tiny_policy):
    """objective.options ref_kl_coef under LoRA: the reference's log-probs equal the base's, loaded again on its own
    (log-softmax gathered at the tokens, written out here), while the adapted policy's differ; afterwards the adapters
    are on again and still train; and the learner holds no second copy of the base: every parameter tensor it
    reaches is one of the policy's (data pointers and count), where a full fine-tuning learner holds its own copy."""
    from trustbatch.trainer import Learner

    from llama_rows import learner_batch

    policy, base_dir = tiny_policy
    base = load_policy(base_dir).model.eval()
    apply_lora(policy, r=4, alpha=8.0, dropout=0.0, target_modules="all-linear", base=str(base_dir))
    _perturb_b(policy.model, scale=0.3)
    own = {p.data_ptr() for p in policy.model.parameters()}
    with pytest.raises(ValueError, match="reference=policy.adapter"):
        Learner(policy.model, "grpo", {"ref_kl_coef": 0.04})
    learner = Learner(policy.model, "grpo", {"ref_kl_coef": 0.04}, reference=policy.adapter, micro_batch_size=2,
                      logprob_chunk_size=3, lr=1e-2)
    batch = learner_batch(policy.tokenizer)
    m, C = batch.packed.response_mask, batch.packed.response_mask.shape[1]
    policy.model.train()  # as the learner's steps leave it
    before = learner.logprobs(batch)
    got = learner.reference_logprobs(batch)
    with torch.no_grad():
        logits = base(input_ids=batch.packed.input_ids, attention_mask=batch.packed.attention_mask,
                      position_ids=batch.packed.position_ids).logits[:, -C - 1:-1]
    want = torch.log_softmax(logits.double(), -1).gather(-1, batch.packed.input_ids[:, -C:, None]).squeeze(-1)
    assert float((got.double() - want)[m].abs().max()) < 2e-6
    assert float((before.double() - want)[m].abs().max()) > 1e-2  # the adapters change the policy
    assert torch.equal(learner.logprobs(batch), before) and policy.model.training  # adapters and mode restored
    modules = [v for v in vars(learner).values() if isinstance(v, torch.nn.Module)]
    reached = {p.data_ptr(): p.numel() for mod in modules for p in mod.parameters()}
    assert set(reached) == own and sum(reached.values()) == sum(p.numel() for p in policy.model.parameters())
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    metrics = learner.train_on(batch)
    assert metrics["kl_ref"] > 0 and all(p.requires_grad for n, p in policy.model.named_parameters() if "lora_" in n)
    assert any(not torch.equal(p, lora[n]) for n, p in policy.model.named_parameters() if n in lora)
    full = Learner(base, "grpo", {"ref_kl_coef": 0.04})  # the contrast: full fine-tuning copies the initial policy
    assert not {p.data_ptr() for p in full.reference.parameters()} & {p.data_ptr() for p in base.parameters()}


def test_with_lora_dropout_the_batch_ess_is_the_policys_whatever_the_micro_batches(tiny_policy):
    """A training forward with dropout is a random sample of the policy. With several micro-batches P3O's batch ESS
    came from the no-grad pass (the policy, as the engine samples it); with one, from the dropout sample: the logged
    ESS, and the cap and KL weight with it, moved with micro_batch_size. The reference: Eq. 11 over the batch's
    tokens from the policy in eval mode."""
    from trustbatch.trainer import Learner

    from llama_rows import learner_batch

    policy, base_dir = tiny_policy
    apply_lora(policy, r=4, alpha=8.0, dropout=0.5, target_modules="all-linear", base=str(base_dir))
    _perturb_b(policy.model, scale=0.3)
    batch = learner_batch(policy.tokenizer)
    p, m, C = batch.packed, batch.packed.response_mask, batch.packed.response_mask.shape[1]
    policy.model.eval()
    with torch.no_grad():
        logits = policy.model(input_ids=p.input_ids, attention_mask=p.attention_mask,
                              position_ids=p.position_ids).logits[:, -C - 1:-1]
    logp = torch.log_softmax(logits.double(), -1).gather(-1, p.input_ids[:, -C:, None]).squeeze(-1)
    rho = (logp - batch.behavior_logprobs.double())[m].exp()
    want = float(rho.sum() ** 2 / (rho.numel() * (rho * rho).sum()))
    assert want < 0.95
    for micro in (len(batch), 2):
        torch.manual_seed(0)
        learner = Learner(policy.model, "p3o", micro_batch_size=micro, lr=0.0)
        assert learner.step(copy.deepcopy(batch))["ess"] == pytest.approx(want, rel=1e-5), micro


@pytest.mark.parametrize("extra", [dict(use_rslora=True), dict(alpha_pattern={"v_proj": 32}),
                                   dict(rank_pattern={"v_proj": 4})], ids=["rslora", "alpha_pattern", "rank_pattern"])
def test_an_adapter_peft_saved_loads_as_peft_merges_it(shared_dir, tmp_path, extra):
    """``load_policy`` on an adapter peft itself wrote (``eval --model DIR``, ``model.path=DIR``) gives peft's own
    ``merge_and_unload()``: the adapter was rebuilt from r and alpha alone (rslora's and alpha_pattern's scaling
    α/r instead of α/√r or the layer's α: logits 5.6 off; rank_pattern a size-mismatch traceback)."""
    import peft
    from transformers import AutoModelForCausalLM

    base = shared_dir / "models" / "stories260K-hf"
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    wrapped.save_pretrained(tmp_path / "adapter")
    reference = wrapped.merge_and_unload().eval()
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, load_policy(tmp_path / "adapter").model.eval()(ids).logits
    assert (want - got).abs().max() <= 1e-5


def test_a_dora_adapter_is_refused_in_one_line(shared_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(shared_dir / "models" / "stories260K-hf"),
                        peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)).save_pretrained(tmp_path / "a")
    with pytest.raises(UserError, match="uses DoRA, which trustbatch cannot merge") as e:
        load_policy(tmp_path / "a")
    assert "\n" not in str(e.value)


def test_a_lora_run_from_a_lora_checkpoint_exports_both_adapters_merged(tmp_path, cache):
    """A LoRA run whose model.path is another LoRA run's checkpoint trains on that checkpoint merged; its own
    checkpoints name it as their base, and load there too (export refused: 'not a model directory')."""
    quiet = Console(file=io.StringIO())
    args = TINY + LORA + ["train.steps=1"]
    train(load_config(None, args + [f"run_dir={tmp_path / 'one'}"]), console=quiet)
    first = tmp_path / "one" / "checkpoints" / "step_000001"
    train(load_config(None, args + [f"run_dir={tmp_path / 'two'}", f"model.path={first}"]), console=quiet)
    second = tmp_path / "two" / "checkpoints" / "step_000001"
    stage_one, both = load_policy(first).model.eval(), load_policy(second).model.eval()
    # by hand: stage one merged, then stage two's W + (α/r)·B·A on top, under the base's names
    expected = dict(stage_one.state_dict())
    adapter, cfg = _adapter(second), json.loads((second / "adapter_config.json").read_text())
    for key in [k for k in adapter if ".lora_A." in k]:
        weight = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        expected[weight] = expected[weight] + cfg["lora_alpha"] / cfg["r"] * (b @ adapter[key])
    got = both.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], atol=1e-6, rtol=0) for k in got)
    assert any(not torch.equal(got[k], stage_one.state_dict()[k]) for k in got)  # stage two trained something


def test_an_adapter_whose_tensors_its_config_does_not_name_is_refused(shared_dir, tmp_path):
    """peft only warns on tensors the config has no layer for (v_proj's, with target_modules [q_proj]): the model
    loaded with those adapters dropped, logits 16.8 off the checkpoint's merged weights."""
    import peft
    from transformers import AutoModelForCausalLM

    base = shared_dir / "models" / "stories260K-hf"
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    with pytest.raises(UserError, match="the adapter's tensors do not match its adapter_config.json") as e:
        load_policy(tmp_path / "a")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("torn", [b'{"base_model_name_or_path": "x", "r": ', b"[1, 2]", b"\xff\xfe{}"])
def test_a_torn_adapter_config_is_one_line(shared_dir, tmp_path, torn):
    """eval -m and export of a LoRA checkpoint whose adapter_config.json a copy tore ended in a JSONDecodeError
    traceback (a full checkpoint's torn config.json is one line)."""
    import peft
    from transformers import AutoModelForCausalLM

    base = shared_dir / "models" / "stories260K-hf"
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_bytes(torn)
    with pytest.raises(UserError, match=r"adapter_config.json' is not .*copy the checkpoint again") as e:
        load_policy(tmp_path / "a")
    assert "\n" not in str(e.value)
