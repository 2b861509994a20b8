"""A random Llama whose next-token distributions are peaked, for the decode-loop tests (tests/unit and tests/gpu).

At the default init (std 0.02) every next-token distribution is nearly uniform; here the blocks' matrices are
drawn with std 0.3 and the final norm's gain set to 8 (as tests/integration/test_engine_contract.py does), so
samples differ between rows and EOS (id 2) ends some completions but not all. Grouped-query attention (4 heads,
2 key/value heads); pad 0, BOS 1, EOS 2.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def peaked_llama(vocab: int = 40, hidden: int = 32, layers: int = 2, positions: int = 512) -> LlamaForCausalLM:
    """The model, float32, in eval mode, on the CPU."""
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.model.layers.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
        m.model.norm.weight.fill_(8.0)
    return m
