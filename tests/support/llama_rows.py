"""A tiny float64 Llama and shuffled rows of grouped completions, for the tests that compare learner forwards.

Float64 models here compute RMSNorm in float64: transformers' LlamaRMSNorm casts to float32
inside (``hidden_states.to(torch.float32)``), so a float64 Llama's gradients carry float32
rounding, and summing a prompt's gradient over its completions before that cast (shared) or after
it (plain) differs by ~1e-8 relative. With the norm in float64 both agree to ~1e-15. Log-probs
of a float64 model are float64 in every path (the log-prob contract, ``chunked_logprobs.logits_dtype``).
"""

import copy
import types

import torch

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
PROMPT_LENS = (1, 3, 6, 2)  # one-token prompts have no prefix to share: their rows still join the passes
G = 4


def _f64_rmsnorm(self, h):
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _llama(dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(dtype)
    if dtype == torch.float64:
        for mod in model.modules():
            if type(mod).__name__ == "LlamaRMSNorm":
                mod.forward = types.MethodType(_f64_rmsnorm, mod)
    return model


def _rows(seed=1, prompt_lens=PROMPT_LENS, g=G):
    """Groups of g rows sharing a prompt, prompts of different lengths, completions of 1..6 tokens, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for n in prompt_lens:
        p = torch.randint(3, 40, (n,), generator=gen).tolist()
        for _ in range(g):
            prompts.append(p)
            comps.append(torch.randint(3, 40, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist())
    order = torch.randperm(len(prompts), generator=gen).tolist()
    return [prompts[i] for i in order], [comps[i] for i in order]


def _close(got, want, what, tol):
    got, want = got.detach(), want.detach()
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= tol * scale + 1e-300, f"{what}: max |diff| {err:.3g} vs scale {scale:.3g} (tol {tol:g})"


def learner_batch(tok, seed=0):
    """Six random prompt/completion rows with behaviour log-probs in [-6, -2] and random advantages."""
    from trustbatch.pipeline.batch import TrainBatch
    from trustbatch.policy.forward import pack

    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(3, len(tok), (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (6,), generator=g)]
    comps = [torch.randint(3, len(tok), (int(n),), generator=g).tolist() + [2] for n in torch.randint(0, 4, (6,), generator=g)]
    packed = pack(prompts, comps, 0)
    C = packed.response_mask.shape[1]
    blp = torch.where(packed.response_mask, -torch.rand(6, C, generator=g) * 4 - 2, 0.0)
    return TrainBatch(packed, blp, torch.randn(6, generator=g))


def full64(model, packed, temperature=1.0):
    """[B, C, V] log-softmax of ``model`` at the completion positions (a plain full-sequence forward)."""
    C = packed.response_mask.shape[1]
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                   position_ids=packed.position_ids).logits[:, -C - 1:-1]
    return torch.log_softmax(logits / temperature, -1)


def perturbed(model, seed, scale=0.3):
    """A copy of ``model`` with Gaussian noise of std ``scale`` added to every weight (another policy)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other
