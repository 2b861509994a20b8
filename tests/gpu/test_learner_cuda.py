"""On CUDA: FSDP2 at world size 1 against the unsharded learner, LoRA's merged weights (unsharded and under FSDP2),
padding-free learning, and the regionally compiled learner step (``train.compile``) against the eager one.

References: an unsharded learner's step on a copy of the same model; ``W + (α/r)·B·A`` written out from the layer's
own tensors and peft's ``merge_and_unload``; the padded learner's gradient.
"""

import copy
import socket

import pytest
import torch

from trustbatch.pipeline.batch import TrainBatch
from trustbatch.pipeline.weight_sync import named_weights
from trustbatch.policy import Policy
from trustbatch.policy.forward import pack
from trustbatch.policy.lora import apply_lora
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer
from trustbatch.trainer import Learner

from grad_probe import sgd_recording_grads
from llama_rows import _close, _llama, _rows
from test_heads_and_packing import _qwen


def _rl_batch(rows=8, prompt=24, completion=40, vocab=4096, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    comps = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, completion, (rows,), generator=g)]
    packed = pack(prompts, comps, 0)
    blp = torch.where(packed.response_mask, -torch.rand(packed.response_mask.shape, generator=g) * 2 - 8, 0.0)
    return TrainBatch(packed, blp, torch.randn(rows, generator=g))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_at_world_size_one_equals_the_unsharded_learner(monkeypatch):
    import torch.distributed as dist

    from trustbatch.parallel import _fully_shard, full_model_state

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        base = _qwen()
        plain, sharded = copy.deepcopy(base), _fully_shard(copy.deepcopy(base), 1, None)
        batch = _rl_batch()
        for m in (plain, sharded):
            Learner(m, "grpo", micro_batch_size=4, logprob_chunk_size=16, warmup_steps=0).step(batch)
        full, ref = full_model_state(sharded), plain.state_dict()
        moved = max(float((ref[k].cpu() - base.state_dict()[k].cpu()).abs().max()) for k in ref)
        assert moved > 0  # the step changed the weights: the comparison below is not vacuous
        for k in ref:  # one rank: FSDP2's all-gathers and reductions are copies; float32 round-off at most
            _close(full[k].float(), ref[k].cpu().float(), f"weight {k}", 1e-6)
    finally:
        dist.destroy_process_group()


def _lora_policy(tmp_path, layers: int = 1) -> tuple[Policy, dict[str, torch.Tensor]]:
    """A tiny Llama on CUDA with r=4, alpha=8 adapters on every linear layer and a nonzero B (peft starts it at 0,
    which would hide the merge), and the base's state before the adapters."""
    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3", "State the answer"], vocab_size=300)
    model = build_small_llama(len(tok), hidden=32, layers=layers, heads=2, max_len=32, seed=0, tokenizer=tok)
    policy = Policy(model.to("cuda"), tok, tok.eos_token_id, tok.pad_token_id)
    base = {k: v.clone() for k, v in policy.model.state_dict().items()}
    apply_lora(policy, r=4, alpha=8.0, dropout=0.0, target_modules="all-linear", base=str(tmp_path))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.02)
    return policy, base


def test_lora_merged_weights_on_cuda(tmp_path):
    policy, base = _lora_policy(tmp_path)
    params = dict(policy.model.named_parameters())
    sent = dict(named_weights(policy.model))
    assert sorted(sent) == sorted(base)
    adapted = 0
    for k, w in base.items():
        stem = k.removesuffix(".weight")
        if f"{stem}.lora_A.default.weight" in params:
            A, B = params[f"{stem}.lora_A.default.weight"], params[f"{stem}.lora_B.default.weight"]
            torch.testing.assert_close(sent[k], w + 2.0 * (B @ A), rtol=0, atol=1e-6)
            adapted += 1
        else:
            assert torch.equal(sent[k], w), k
    assert adapted == 7
    peft_merged = copy.deepcopy(policy.adapter).merge_and_unload().state_dict()
    for k in sent:
        torch.testing.assert_close(sent[k], peft_merged[k], rtol=0, atol=1e-6)


def test_lora_under_fsdp2_at_world_size_one_sends_merged_weights_and_saves_the_adapter(monkeypatch, tmp_path):
    """A LoRA policy sharded by FSDP2 on NCCL: ``named_weights`` (what engines receive, merged on the DTensor shards
    and gathered) against ``W + (α/r)·B·A`` written out from the tensors before sharding, and the checkpoint's
    adapter (gathered with ``full_model_state(..., trainable_only=True)``) against those tensors, in peft's files."""
    import json

    import torch.distributed as dist
    from safetensors.torch import load_file

    from trustbatch.parallel import _fully_shard, full_model_state
    from trustbatch.policy.lora import save_adapter

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        policy, _ = _lora_policy(tmp_path, layers=2)
        params = {n: t.detach().cpu().clone() for n, t in policy.model.state_dict().items()}  # the tied head too
        adapters = {n: p for n, p in params.items() if ".lora_" in n}
        _fully_shard(policy.model, 1, None)
        sent = dict(named_weights(policy.model))
        adapted = 0
        for k, w in sent.items():
            stem = k.removesuffix(".weight")
            if f"{stem}.lora_A.default.weight" in params:
                A, B = params[f"{stem}.lora_A.default.weight"], params[f"{stem}.lora_B.default.weight"]
                want = params[f"{stem}.base_layer.weight"].double() + 2.0 * B.double() @ A.double()
                torch.testing.assert_close(w.cpu().double(), want, rtol=0, atol=1e-6)
                adapted += 1
            else:
                assert not isinstance(w, torch.distributed.tensor.DTensor), k
                assert torch.equal(w.cpu(), params[k]), k
        assert adapted == 14
        save_adapter(policy, tmp_path / "ckpt", state_dict=full_model_state(policy.adapter, trainable_only=True))
        saved = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
        assert len(saved) == len(adapters) == 28
        for n, t in adapters.items():  # peft saves base_model.model.<name> without the adapter's name
            assert torch.equal(saved["base_model.model." + n.replace(".default.", ".")], t), n
        config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
        assert config["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"
    finally:
        dist.destroy_process_group()


def test_padding_free_learner_step_equals_padded_in_float64():
    prompts, comps = _rows(seed=4)
    packed = pack(prompts, comps, pad_id=0)
    B, C = packed.response_mask.shape
    grads = []
    for padding_free in (False, True):
        model = _llama(torch.float64).to("cuda")
        learner = Learner(model, "p3o", {}, lr=1e-2, grad_clip=1e9, micro_batch_size=5, padding_free=padding_free)
        grads.append(sgd_recording_grads(learner, model))
        g = torch.Generator().manual_seed(11)
        blp = -3.0 + 0.8 * torch.randn(B, C, generator=g, dtype=torch.float64)
        learner.step(TrainBatch(packed, blp, torch.randn(B, generator=g, dtype=torch.float64)))
    assert grads[0] and grads[0].keys() == grads[1].keys()  # both optimizer steps were recorded
    for n in grads[0]:
        _close(grads[1][n], grads[0][n], f"grad {n}", 1e-10)


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_the_compiled_learner_step_equals_the_eager_one(precision):
    """``train.compile`` (inductor on CUDA) against the eager step on a copy of the same model and batch, SGD.
    float32: round-off of fused kernels (TF32 off), 1e-5 of each gradient's scale. bf16-mixed: inductor's
    ``emulate_precision_casts`` rounds to bf16 where eager ops do, but fused reductions sum in another order
    before each rounding, so values may land one bf16 ulp apart per rounding: 8 ulps after the 2 layers' forward and
    backward, as the chunked-head test allows."""
    base = _qwen()
    batch = _rl_batch()
    grads = []
    for backend in (None, "inductor"):
        model = copy.deepcopy(base)
        learner = Learner(model, "grpo", micro_batch_size=4, logprob_chunk_size=16, warmup_steps=0,
                          precision=precision, compile_backend=backend)
        grads.append(sgd_recording_grads(learner, model))
        learner.step(batch)
    tol = 1e-5 if precision == "float32" else 8 * 2.0 ** -8
    assert max(float(g.abs().max()) for g in grads[0].values()) > 0
    for n in grads[0]:
        _close(grads[1][n], grads[0][n], f"{precision} compiled grad {n}", tol)
