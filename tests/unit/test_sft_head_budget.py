"""The SFT warm-up (``policy.sft.sft``, ``trustbatch sft``) runs its LM head in the learner's budget: it built the
whole [batch, C + 1, V] logits (64 rows × 33 positions × 151,936 at the default batch: 1.28 GB), where the learner
keeps each head call to ``logit_tokens(V)`` positions (256 MiB).

The budget is lowered here (a stand-in for ``logit_tokens``, called with the model's V) so that a tiny vocabulary
takes the chunked path; the reference is the token-mean NLL of the answers from a plain float64 forward."""

import torch

import trustbatch.policy.sft as sft_module
from trustbatch.policy import Policy
from trustbatch.policy.model import build_small_llama
from trustbatch.policy.tokenizer import train_tokenizer

DEMOS = [("What is 1 + 2?", " 3"), ("What is 4 - 1?", " 3 and so on"), ("State the answer.", " 12 + 1 = 13")]


def test_sft_runs_the_lm_head_in_chunks_of_the_budget_and_computes_the_same_loss(monkeypatch):
    tok = train_tokenizer([p + c for p, c in DEMOS], vocab_size=300)
    model = build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=64, seed=0, tokenizer=tok).double()
    policy = Policy(model, tok, tok.eos_token_id, tok.pad_token_id)
    asked = []
    monkeypatch.setattr(sft_module, "logit_tokens", lambda v: asked.append(v) or 8)
    # by hand: one step's batch is drawn as sft draws it (seeded), then the NLL of its answers and EOS
    rng = __import__("random").Random(5)
    rows = [DEMOS[rng.randrange(len(DEMOS))] for _ in range(4)]
    with torch.no_grad():
        nll, n = 0.0, 0
        for p, c in rows:
            prompt, answer = policy.encode_prompt(p), policy.encode_completion(c)
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].double()
            nll -= float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None]).sum())
            n += len(answer)
    seen = []  # the positions of each LM-head call: the chunked head multiplies by its weight itself (0 here)
    model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape[0] * out.shape[1]))
    loss = sft_module.sft(policy, DEMOS, steps=1, batch_size=4, lr=0.0, seed=5)
    assert asked == [len(tok)]
    assert seen == [0]  # no logits through the module: the decoder's hidden states went to the chunked head
    assert abs(loss - nll / n) < 1e-10
