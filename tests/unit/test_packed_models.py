"""Padding-free forwards across transformers' decoder types: each packed layout equals each row run alone.

The reference is independent of packing and padding: every ``prompt + completion`` through the model by itself,
no mask, ``log_softmax`` of its logits at the completion positions (float64). A type whose attention would cross
packed sequences (ALiBi, OPT) must fall back to the padded forward; one with sliding-window layers must not get the
prefix-tree mask, which every layer takes as given (the window was dropped: 8e-3 off on Mistral, 2e-2 on Gemma2).
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trustbatch.policy.forward import pack
from trustbatch.policy.packed import packed_response_logprobs

V = 37
# type -> (config overrides beyond the tiny dims, attention implementation)
TYPES = {
    "llama": ({}, "sdpa"),
    "qwen2": ({}, "sdpa"),
    "qwen2_window": ({"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}, "sdpa"),
    "mistral_window": ({"sliding_window": 3}, "sdpa"),
    "gemma2": ({"sliding_window": 3, "final_logit_softcapping": 5.0}, "eager"),
    "gpt2": ({}, "sdpa"),
    "phi": ({}, "sdpa"),
    "opt": ({"ffn_dim": 32, "word_embed_proj_dim": 16}, "sdpa"),
    "bloom": ({}, "eager"),
    "mpt": ({}, "eager"),
    # BioGPT's causal mask ignores position_ids, and Mamba's recurrent state ran on from one packed sequence into the
    # next: packed, they were 1.4 and 0.8 nats off; both take the padded forward
    "biogpt": ({}, "sdpa"),
    "mamba": ({}, "eager"),
}
# the padded eager forward of the ALiBi types is NaN in float64 inside transformers (a left-padded row's masked
# scores overflow): they run in float32, where packing crossed sequences by 1.6e-5 (Bloom) and 1.2e-3 (MPT)
FLOAT32 = {"bloom": 1e-6, "mpt": 1e-6}
TOLERANCE = {**FLOAT32, "mamba": 1e-6}  # its selective scan runs in float32 inside transformers, padded or not
TINY = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=32, n_embd=16, n_layer=2, n_head=2, d_model=16, n_layers=2, n_heads=2, head_dim=8,
            max_position_embeddings=64, n_positions=64, pad_token_id=0)


def _model(name):
    extra, attn = TYPES[name]
    kind = name.split("_")[0]
    known = AutoConfig.for_model(kind)
    # given to the constructor, so that what it derives (Qwen2's layer_types from its window) follows
    cfg = AutoConfig.for_model(kind, **{k: v for k, v in TINY.items() if hasattr(known, k)}, **extra)
    torch.manual_seed(0)
    dtype = torch.float32 if name in FLOAT32 else torch.float64
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype).eval()


def _alone(model, prompts, comps, width):
    """Each row by itself, unpadded and unmasked: log-probs of its completion, right-aligned in ``[B, width]``."""
    out = torch.zeros(len(prompts), width, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].double(), -1)
        out[i, width - len(c):] = logp[len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
    return out


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared_prompts"])
def test_every_packed_layout_equals_each_row_alone(name, share):
    model = _model(name)
    g = torch.Generator().manual_seed(5)
    draw = lambda n: torch.randint(3, V, (n,), generator=g).tolist()  # noqa: E731
    # prompts longer than the window of 3; the p2 rows (5 and 6 tokens) share a packed row no longer than the
    # longest sequence (14), so their attention must stop at the restart
    p1, p2 = draw(8), draw(3)
    prompts, comps = [p1, p1, p1, p2, p2], [draw(6), draw(3), draw(5), draw(2), draw(3)]
    packed = pack(prompts, comps, 0)
    m = packed.response_mask
    with torch.no_grad():
        want = _alone(model, prompts, comps, m.shape[1])
        got = packed_response_logprobs(model, packed, share_prompts=share, min_saving=0.0)[0]
    err = float((got[m].double() - want[m]).abs().max())
    assert err <= TOLERANCE.get(name, 1e-10), err


@pytest.mark.parametrize("name", ["gpt2", "gemma2"])
def test_a_head_the_chunked_path_cannot_split_runs_on_the_predicting_columns_only(name):
    """Packed, such a model's head ran on every token (prompts included): [R, W, V] logits where the padded path
    keeps C + 1 columns. Reference: the head's input width, against the completion columns counted by hand, and the
    log-probs of each row alone."""
    model = _model(name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (30,), generator=g).tolist() for _ in range(4)]
    comps = [torch.randint(1, V, (n,), generator=g).tolist() for n in (2, 1, 2, 2)]
    packed = pack(prompts, comps, pad_id=0)
    widths = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: widths.append(a[0].shape[:2]))
    try:
        logp, _ = packed_response_logprobs(model, packed, share_prompts=False)
    finally:
        hook.remove()
    assert widths and all(rows * cols <= 4 * 3 for rows, cols in widths), widths  # ≤ 4 rows × 3 columns, not 4 × 32
    want = _alone(model, prompts, comps, packed.response_mask.shape[1])
    m = packed.response_mask.bool()
    assert float((logp.double() - want)[m].abs().max()) <= 1e-10
