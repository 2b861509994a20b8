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
    ({"temperature": 0.0}, "--temperature and --timeout must be > 0"),
    ({"workers": -1}, "--workers >= 0"),
    ({"engine": "sglang"}, "--engine 'sglang' must be transformers or vllm"),
    ({"device": "gpu"}, "--device 'gpu' must be auto, cpu, cuda or cuda:N"),
    ({"reward": "nosuch"}, "unknown reward 'nosuch'"),
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


def test_save_results_writes_nan_as_null(tmp_path):
    dest = save_results({"average": {"pass@1": 0.5, "pass@1_se": float("nan")}, "k": [1]}, tmp_path / "r.json")
    assert json.loads(dest.read_text()) == {"average": {"pass@1": 0.5, "pass@1_se": None}, "k": [1]}
