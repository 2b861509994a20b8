"""Regional compilation (``train.compile``, ``policy.compile``): the compiled learner step equals the eager one, the
compiled forward runs only where autograd records, and bad input is refused.

Reference: the same learner without ``compile_backend`` on a fresh copy of the same model and batch, float32, SGD
(``grad_probe``). Backend ``aot_eager``: dynamo's graph capture and AOT autograd's forward and backward graphs, run
by eager kernels, so the test takes seconds, not a C++ compile; the real command with inductor is
``tests/integration/test_compile_train.py``, on CUDA ``tests/gpu/test_learner_cuda.py``.
"""

import pytest
import torch

from trustbatch.policy.compile import TrainingForward, compile_blocks
from trustbatch.trainer.learner import Learner

from grad_probe import sgd_recording_grads
from llama_rows import TOL, _close, _llama
from test_trim_micro_batches import _sorted_batch

FORWARDS = {"shared_prompt": {}, "plain": {"shared_prompt": False}, "padding_free": {"padding_free": True},
            "activation_checkpointing": {"activation_checkpointing": True}}


def _spy(model) -> list:
    """Count each block's compiled calls (with or without autograd recording)."""
    calls = []
    for block in model.model.layers:
        real = block.forward.compiled
        block.forward.compiled = lambda *a, _real=real, **kw: calls.append(torch.is_grad_enabled()) or _real(*a, **kw)
    return calls


@pytest.mark.parametrize("forward", list(FORWARDS))
def test_the_compiled_step_equals_the_eager_one(forward):
    torch._dynamo.reset()
    grads, calls = [], []
    for backend in (None, "aot_eager"):
        model = _llama(torch.float32)
        learner = Learner(model, "p3o", {}, lr=1e-2, grad_clip=1e9, micro_batch_size=4, compile_backend=backend,
                          **FORWARDS[forward])
        if backend is not None:
            calls = _spy(model)
        grads.append(sgd_recording_grads(learner, model))
        learner.step(_sorted_batch(torch.float32))
    want, got = grads
    assert calls and all(calls), "the step did not run the compiled blocks"
    for n in want:
        _close(got[n], want[n], f"{forward} {n}", TOL[torch.float32])
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3


def test_no_grad_forwards_run_the_eager_blocks():
    model = _llama(torch.float32)
    assert compile_blocks(model, "aot_eager") == 2 and compile_blocks(model, "aot_eager") == 2  # once, not twice
    assert all(isinstance(b.forward, TrainingForward) and not isinstance(b.forward.eager, TrainingForward)
               for b in model.model.layers)
    calls = _spy(model)
    x = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        model(x)
    assert calls == []
    model(x).logits.sum().backward()
    assert calls == [True, True]


def test_a_copy_of_a_compiled_model_trains_its_own_weights():
    """Snapshots and engine copies are deep copies: each copied block compiles its own forward, so a copy's
    gradient-recording forward computes with the copy's weights, not the original's."""
    import copy

    model = _llama(torch.float32)
    compile_blocks(model, "aot_eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    x = torch.randint(0, 40, (1, 5))
    eager = _llama(torch.float32)
    eager.load_state_dict(twin.state_dict())
    torch.testing.assert_close(twin(x).logits, eager(x).logits, rtol=0, atol=1e-6)  # with autograd recording
    assert float((twin(x).logits - model(x).logits).detach().abs().max()) > 1e-3


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        compile_blocks(_llama(torch.float32), "tensorrt")
    with pytest.raises(ValueError, match="has no decoder blocks to compile"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_a_deep_model_compiles_one_graph_for_all_its_blocks():
    """Ten blocks, groups of rows sharing a prompt: every block reuses one graph (a second shape adds at most one
    dynamic one). The shared-prompt forward would hand each block the cache's per-layer state, a guard per layer:
    ten graphs, and blocks past dynamo's recompile limit (8) silently eager; the compiled learner runs the plain
    forward instead (measured before the fix: 10 graphs here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=10,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    learner = Learner(model, "p3o", {}, lr=1e-2, micro_batch_size=4, compile_backend="eager")
    for block in model.model.layers:
        block.forward.compiled = torch.compile(block.forward.eager, backend=backend)
    calls = _spy(model)
    batch = _sorted_batch(torch.float32)
    assert len(set(map(tuple, batch.packed.input_ids[:, :2].tolist()))) < batch.packed.input_ids.shape[0]
    learner.step(batch)
    assert len(calls) >= 10 and all(calls) and 1 <= len(graphs) <= 2, len(graphs)
