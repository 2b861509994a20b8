"""``recipes.evaluate`` called with plain arguments: its checks come before the model loads, and pass@k matches the
unbiased estimator worked by brute force over the per-prompt counts it reports."""

import json
import math

import pytest

from trustbatch.errors import UserError
from trustbatch.recipes.evaluate import evaluate, parse_ks, save_results


def has_e(completion: str, reference: str) -> float:
    """A reward with spread for a story model: 1 when the completion contains an 'e'."""
    return 1.0 if "e" in completion else 0.0


def test_parse_ks_sorts_and_checks_against_n():
    assert parse_ks("4, 1,2,2", 4) == [1, 2, 4]
    with pytest.raises(UserError, match="comma-separated integers"):
        parse_ks("1,x", 4)
    with pytest.raises(UserError, match=r"need 1 <= k <= n for every k; got n=2, k='1,4'"):
        parse_ks("1,4", 2)


@pytest.mark.parametrize("kw, message", [
    ({"ks": [0, 1]}, "need 1 <= k <= n"),
    ({"temperature": 0.0}, r"^--temperature must be a finite number > 0 \(pass@k is over samples\) \(got 0.0\)$"),
    ({"temperature": float("inf")}, r"^--temperature must be a finite number > 0 .*\(got inf\)$"),  # a traceback
    ({"workers": -1}, r"^--workers must be >= 0 \(got -1\)$"),  # only the option that is wrong is named
    ({"max_new_tokens": 0}, r"^--max-new-tokens must be >= 1 \(got 0\)$"),  # 0 sampled the default 256
    ({"precision": "bf16"}, "--precision 'bf16' must be float32 or bf16-mixed"),
    ({"engine": "vllm", "precision": "bf16-mixed"}, "--precision bf16-mixed is the transformers engine's autocast"),
    ({"limit": 0, "timeout": -1.0}, r"^--limit must be >= 1 \(got 0\); --timeout must be > 0 \(got -1.0\)$"),
    ({"engine": "sglang"}, "--engine 'sglang' must be transformers or vllm"),
    ({"device": "gpu"}, "--device 'gpu' must be auto, cpu, cuda or cuda:N"),
    ({"reward": "nosuch"}, "unknown reward 'nosuch'"),
    ({"decode": "fast"}, "--decode fast is not one of dynamic, static, static_compiled"),
    ({"noise": "urandom"}, "--noise urandom is not one of"),
    ({"engine": "vllm", "decode": "static"}, "--decode static sets the transformers engine's sampler; vLLM runs its "
                                             "own: drop --decode, or use --engine transformers"),
])
def test_bad_input_raises_before_the_model_loads(kw, message, tmp_path):
    # the model directory does not exist: an error about it would mean the model was loaded first
    with pytest.raises(UserError, match=message):
        evaluate(tmp_path / "no-model", ["gsm8k"], n=2, **{"ks": [1], **kw})


def test_pass_at_k_is_the_unbiased_estimator_over_the_reported_counts(tmp_path, shared_dir):
    n, ks = 4, [1, 2, 4]
    res = evaluate(shared_dir / "models" / "stories260K-hf", ["countdown"], n=n, ks=ks, max_new_tokens=8, limit=3,
                   data_dir=str(shared_dir / "data"), reward=f"{__name__}:has_e", workers=0)
    row = res["benchmarks"]["countdown"]
    assert res["k"] == ks and res["n"] == n and row["prompts"] == 3 and len(row["correct"]) == 3
    assert any(0 < c < n for c in row["correct"])  # the estimator is exercised, not just 0 or 1
    for k in ks:
        # Chen et al. 2021, Eq. 1: 1 - C(n - c, k) / C(n, k), averaged over prompts
        want = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in row["correct"]) / 3
        assert row[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
        assert res["average"][f"pass@{k}"] == pytest.approx(want, abs=1e-12)  # one benchmark: its own average


def test_the_static_loop_evaluates_the_same_samples(monkeypatch, tmp_path, shared_dir):
    """``decode="static"`` samples the dynamic loop's tokens (tests/unit/test_static_decode.py), so every count
    equals the default's; a spy shows the static loop did the sampling."""
    import trustbatch.rollout.static_decode as static_decode

    calls = []
    real = static_decode.StaticDecoder.decode
    monkeypatch.setattr(static_decode.StaticDecoder, "decode", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    kw = dict(n=4, ks=[1, 4], max_new_tokens=8, limit=3, data_dir=str(shared_dir / "data"),
              reward=f"{__name__}:has_e", workers=0)
    model = shared_dir / "models" / "stories260K-hf"
    dynamic = evaluate(model, ["countdown"], **kw)
    assert not calls
    static = evaluate(model, ["countdown"], decode="static", **kw)
    assert calls and static["decode"] == "static" and dynamic["decode"] == "dynamic"
    assert static["benchmarks"]["countdown"]["correct"] == dynamic["benchmarks"]["countdown"]["correct"]
    assert any(0 < c < 4 for c in dynamic["benchmarks"]["countdown"]["correct"])  # counts that could differ


def test_save_results_writes_nan_as_null(tmp_path):
    dest = save_results({"average": {"pass@1": 0.5, "pass@1_se": float("nan")}, "k": [1]}, tmp_path / "r.json")
    assert json.loads(dest.read_text()) == {"average": {"pass@1": 0.5, "pass@1_se": None}, "k": [1]}


def five(completion: str, reference: str) -> float:
    """Out of range on every completion: clamped to 1."""
    return 5


def test_out_of_range_rewards_are_warned_about_as_in_training_and_counted(tmp_path, shared_dir):
    said: list[str] = []
    res = evaluate(shared_dir / "models" / "stories260K-hf", ["countdown"], n=2, ks=[1], max_new_tokens=4, limit=3,
                   data_dir=str(shared_dir / "data"), reward=f"{__name__}:five", workers=0, warn=said.append)
    row = res["benchmarks"]["countdown"]
    assert row["reward_clamped"] == 6 and row["pass@1"] == 1.0  # clamped into [0, 1], so every sample is "correct"
    # the words of a training round's warning (rewards.check_scoring), with the benchmark for the round
    assert said == [f"countdown: reward '{__name__}:five': 0 errors and 0 timeouts in 6 completions (scored 0), "
                    "6 rewards clamped into [0, 1]"]


def _questions(path, *questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n" for q in questions))
    return str(path)


def test_prompts_longer_than_the_context_are_skipped_and_counted_or_refused(tmp_path, shared_dir):
    model = shared_dir / "models" / "stories260K-hf"  # max_position_embeddings 512
    long = "Once upon a time there was a little dog. " * 80  # far past 512 tokens of this model
    bench = _questions(tmp_path / "mixed.jsonl", "What is 1 + 2?", long, "What is 5 - 2?")
    said: list[str] = []
    res = evaluate(model, [bench], n=1, ks=[1], max_new_tokens=8, reward=f"{__name__}:has_e", workers=0,
                   warn=said.append)
    row = next(iter(res["benchmarks"].values()))
    assert row["prompts"] == 2 and row["prompts_skipped"] == 1 and len(row["correct"]) == 2
    assert len(said) == 1 and "skipped 1 of 3 prompts longer than 504 tokens" in said[0], said
    with pytest.raises(UserError, match="none of the 1 prompts fits in 504 tokens"):
        evaluate(model, [_questions(tmp_path / "long.jsonl", long)], n=1, ks=[1], max_new_tokens=8, workers=0)


def test_a_missing_model_is_named_by_evals_own_option(tmp_path):
    """eval's model is --model: the line says so (it said model.path=DIR, a key eval does not take)."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(UserError) as e:
        evaluate(tmp_path / "no-model", [str(data)], n=2, ks=[1])
    assert "does not exist" in str(e.value) and "(--model=DIR)" in str(e.value) and "model.path" not in str(e.value)


def test_a_plain_answer_reward_on_json_answers_is_refused_as_in_training(shared_dir, tmp_path):
    """``--reward gsm8k`` on Countdown scored the last number of each JSON reference (training refuses it); now one
    line before the model loads (no model at that path)."""
    with pytest.raises(UserError, match="^reward 'gsm8k' reads a plain answer, but this data's answers are JSON, "
                                        "scored by 'countdown'; drop it to use 'countdown'$"):
        evaluate(tmp_path / "no-model", ["countdown"], n=1, ks=[1], limit=2, data_dir=str(shared_dir / "data"),
                 reward="gsm8k", workers=0)
    with pytest.raises(UserError, match="no-model"):  # a plain-answer benchmark takes it; the model is next
        evaluate(tmp_path / "no-model", ["gsm8k"], n=1, ks=[1], limit=2, data_dir=str(shared_dir / "data"),
                 reward="math", workers=0)
