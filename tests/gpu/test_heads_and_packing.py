"""On CUDA: the chunked LM head against the full head, and padding-free micro-batches against padded ones.

References are the full head and the padded forward on the same model and device; float64 and float32 checks
are exact up to round-off, bf16-mixed ones within bf16 round-off of the logits (tolerances below).
"""

import pytest
import torch

from trustbatch.policy.forward import pack, response_logprobs
from trustbatch.policy.packed import packed_response_logprobs

from llama_rows import _close, _llama, _rows

BF16_ULP = 2.0 ** -8  # bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-8 of it


def _qwen(dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).to(device="cuda", dtype=dtype).train()


def _batch(rows=6, vocab=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (rows,), generator=g)]
    comps = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 96, (rows,), generator=g)]
    return pack(prompts, comps, pad_id=0).to("cuda")


def _run(fn, model, packed, autocast, **kw):
    model.zero_grad(set_to_none=True)
    weights = torch.randn(packed.response_mask.shape, generator=torch.Generator().manual_seed(3)).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        lp, ent = fn(model, packed, with_entropy=True, **kw)
    (lp * weights * packed.response_mask).sum().backward()
    return lp.detach(), ent, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("head", ["trained", "frozen"])
@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_chunked_head_equals_full_head(precision, head):
    """``frozen``: LoRA's case, the tied head and embeddings without gradient, where the chunked head forms the
    hidden states' gradient in its forward (E_p[W] one bf16 product, as the full path's backward product); the
    same tolerances hold (tests/integration/test_chunked_logprobs.py measures its bf16 error against float64 on
    the CPU: 1.02× the full path's)."""
    model, packed = _qwen(), _batch()
    model.lm_head.weight.requires_grad_(head == "trained")
    m = packed.response_mask
    bf16 = precision == "bf16-mixed"
    full = _run(response_logprobs, model, packed, bf16, chunk_size=None)
    chunked = _run(response_logprobs, model, packed, bf16, chunk_size=16)
    if bf16:
        # Both paths round the same bf16 logits' float32 accumulations once; a different GEMM tiling per chunk
        # can round a logit the other way: ≤ 1 ulp of the largest |logit| on the target's logit and on the
        # log-sum-exp each, so 2 ulps; gradients pass through bf16 matmuls of the backward on 2 layers: 8 ulps.
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            zmax = float(model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits.float().abs().max())
        lp_tol, grad_tol = 2 * BF16_ULP * zmax, 8 * BF16_ULP
    else:
        lp_tol, grad_tol = 1e-5, 1e-5  # float32 round-off of sums over H = 256 and V = 4,096 (TF32 off by default)
    assert float((chunked[0] - full[0])[m].abs().max()) <= lp_tol
    assert float((chunked[1] - full[1])[m].abs().max()) <= max(lp_tol, 1e-5) * 4  # entropy: a sum over V of p·log p
    assert ("model.embed_tokens.weight" in full[2]) == (head == "trained") and set(chunked[2]) == set(full[2])
    for n in full[2]:
        _close(chunked[2][n], full[2][n], f"{precision} grad {n}", grad_tol)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared_prompt"])
def test_padding_free_equals_padded_in_float64(share):
    """The CPU test's claim (tests/unit/test_packed.py) on CUDA's sdpa kernels."""
    model = _llama(torch.float64).to("cuda")
    prompts, comps = _rows()
    packed = pack(prompts, comps, pad_id=0).to("cuda")
    m = packed.response_mask
    want = _run(response_logprobs, model, packed, False)
    got = _run(packed_response_logprobs, model, packed, False, share_prompts=share, min_saving=0.0)
    _close(got[0][m], want[0][m], "log-probs", 1e-10)
    for n in want[2]:
        _close(got[2][n], want[2][n], f"grad {n}", 1e-10)


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_padding_free_equals_padded_on_a_qwen2(precision):
    model, packed = _qwen(), _batch(seed=1)
    m = packed.response_mask
    bf16 = precision == "bf16-mixed"
    want = _run(response_logprobs, model, packed, bf16, chunk_size=32)
    got = _run(packed_response_logprobs, model, packed, bf16, chunk_size=32, share_prompts=False)
    # bf16: every activation of the two layouts is rounded to bf16 after differently tiled kernels: a few ulps of
    # each logit (|logit| ≲ 1 here) on the log-probs; float32: round-off only
    lp_tol, grad_tol = (0.05, 0.05) if bf16 else (1e-4, 1e-4)
    assert float((got[0] - want[0])[m].abs().max()) <= lp_tol
    for n in want[2]:
        _close(got[2][n], want[2][n], f"{precision} grad {n}", grad_tol)
