"""Issue 39 items 3 and 4: what would be ignored or misread is refused with one line, and no wait on a
scorer is unbounded or unexplained.

Each case is made by hand here; the expected values (which keys, which line, which count) are known
from the input, not read from the code. The CLI cases run real ``trustbatch train`` processes
(exit code 2 and one line on stderr); the variants of each check run in this process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trustbatch import objectives
from trustbatch.config import dump_config, load_config
from trustbatch.data.benchmarks import load_benchmark
from trustbatch.errors import UserError
from trustbatch.rewards import RewardPool, check_scoring

from runproc import cache  # noqa: F401  (fixture)
from tiny import TINY

ROOT = Path(__file__).resolve().parents[2]


def _cli(args: list[str], env_extra: dict | None = None, timeout: float = 120) -> tuple[int, list[str], str]:
    """(exit code, non-blank stderr lines, stdout) of ``python -m trustbatch ARGS``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    p = subprocess.run([sys.executable, "-m", "trustbatch", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, [l for l in p.stderr.splitlines() if l.strip()], p.stdout


# ---------------------------------------------------------------- async-only keys in sync mode
def test_async_key_in_sync_mode_is_one_line_exit_2(tmp_path):
    # a tiny run, so that without the check the test fails in seconds (exit 0) rather than training for long
    rc, lines, _ = _cli(["train", *TINY, "train.steps=1", "threads=1", "rollout.max_staleness=3",
                         f"run_dir={tmp_path / 'run'}"], {"TRUSTBATCH_CACHE": str(tmp_path / "cache")})
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("trustbatch: error: rollout.max_staleness=3 is ignored in rollout.mode=sync")
    assert "rollout.mode=async" in lines[0] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["rollout.max_staleness=3", "rollout.max_staleness=auto", "rollout.workers=2",
                                      "rollout.worker_timeout_s=30", "rollout.async_order=latest"])
def test_each_async_only_key_is_refused_in_sync_mode(override):
    key = override.split("=")[0]
    for mode in ([], ["rollout.mode=sync"]):
        with pytest.raises(UserError) as e:
            load_config(None, mode + [override])
        assert "\n" not in str(e.value) and str(e.value).startswith(key + "=")
    cfg = load_config(None, ["rollout.mode=async", override])  # the same key in async mode is read
    assert str(getattr(cfg.rollout, key.split(".")[1])) == override.split("=")[1].replace("30", "30.0")


def test_async_only_keys_at_their_defaults_and_saved_configs_still_load(tmp_path):
    # a saved config.yaml holds every key: a sync run's must reload (resume, a lab run's seed file)
    load_config(None, ["rollout.max_staleness=0", "rollout.workers=1", "rollout.worker_timeout_s=300"])
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(load_config(None, TINY)))
    assert "max_staleness: 0" in saved.read_text() and "worker_timeout_s: 300.0" in saved.read_text()
    assert load_config(saved).rollout.mode == "sync"


# ---------------------------------------------------------------- scorer return values
SCORERS = """
import numpy as np
def as_string(c, r):
    return "0.75"
def as_numpy(c, r):
    return np.float32(0.75) if c == "a" else np.bool_(True) if c == "b" else np.int64(0)
def as_tensor(c, r):
    import torch
    return torch.tensor(0.75)
def as_none(c, r):
    return None
def as_list(c, r):
    return [0.75]
"""


@pytest.fixture
def scorer_module(tmp_path, monkeypatch):
    (tmp_path / "tb_returns.py").write_text(SCORERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tb_returns"
    sys.modules.pop("tb_returns", None)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fn, shown", [("as_string", "str '0.75'"), ("as_tensor", "Tensor tensor(0.7500)"),
                                       ("as_none", "NoneType None"), ("as_list", "list [0.75]")])
def test_a_non_number_from_a_scorer_is_an_error_not_a_score(scorer_module, workers, fn, shown):
    with RewardPool(f"{scorer_module}:{fn}", workers=workers) as pool:
        res = pool.score(["a", "b", "c"], ["x", "y", "z"])
    assert res.rewards == [0.0, 0.0, 0.0] and res.errors == 3 and res.clamped == 0
    assert f"the scorer returned {shown}, not a number" in res.last_error
    with pytest.raises(UserError) as e:  # the round's rule stops the run with one line naming the cause
        check_scoring(res, scorer=f"{scorer_module}:{fn}", max_failure_rate=0.5, where="round 1")
    assert "\n" not in str(e.value) and f"returned {shown}" in str(e.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_numpy_scalars_still_score(scorer_module, workers):
    with RewardPool(f"{scorer_module}:as_numpy", workers=workers) as pool:
        res = pool.score(["a", "b", "c"], ["x", "y", "z"])
    assert res.rewards == [0.75, 1.0, 0.0] and res.errors == 0


# ---------------------------------------------------------------- integer log-probs at the objective boundary
LOGPROB_ARGS = [(name, arg) for name in objectives.names() for arg in ("logprobs", "behavior_logprobs", "proximal_logprobs")
                if arg != "proximal_logprobs" or objectives.spec(name).needs_proximal]


@pytest.mark.parametrize("name, arg", LOGPROB_ARGS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_logprobs_are_refused_before_any_computation(name, arg, dtype):
    spec = objectives.spec(name)
    B, T = 2, 3
    kw = {"logprobs": torch.full((B, T), -1.0, requires_grad=True), "behavior_logprobs": torch.full((B, T), -1.0),
          "advantages": torch.tensor([1.0, -1.0]), "mask": torch.ones(B, T, dtype=torch.bool)}
    if spec.needs_proximal:
        kw["proximal_logprobs"] = torch.full((B, T), -1.0)
    kw[arg] = torch.zeros(B, T, dtype=dtype)  # token ids or a 0/1 mask passed by mistake
    with pytest.raises(ValueError) as e:
        spec.fn(**kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{arg} has dtype {dtype}") and "floating-point" in msg


def test_integer_full_logprobs_are_refused():
    B, T, V = 1, 2, 3
    full = torch.log_softmax(torch.zeros(B, T, V), -1)
    lp = torch.full((B, T), float(full[0, 0, 0]), requires_grad=True)
    args = (lp, lp.detach().clone(), torch.ones(B), torch.ones(B, T, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^behavior_logprobs_full has dtype torch.int64"):
        objectives.get("p3o")(*args, kl="exact", logprobs_full=full.requires_grad_(),
                              behavior_logprobs_full=torch.zeros(B, T, V, dtype=torch.int64))


# ---------------------------------------------------------------- an empty gold answer in the data
GSM_OK = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.mark.parametrize("answer", ["Tom has 3 apples and buys 4 more: 3 + 4 = 7.\n#### ", "3 + 4 = 7\n#### 7\n####",
                                    "12 eggs\n####    "])
def test_gsm8k_row_with_an_empty_final_answer_names_file_and_line(tmp_path, answer):
    f = tmp_path / "g.jsonl"
    rows = [GSM_OK, {"question": "What is 9 + 1?", "answer": "#### 10"}, {"question": "Apples?", "answer": answer}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(UserError) as e:
        load_benchmark(str(f))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{str(f)!r} line 3: ") and "'####' is followed by no number" in msg


def test_gsm8k_answers_that_end_in_a_number_still_load(tmp_path):
    f = tmp_path / "g.jsonl"
    rows = [GSM_OK, {"question": "Cost?", "answer": "#### $1,250"}, {"question": "Half?", "answer": "x\n####0.5"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [e.reference for e in load_benchmark(str(f)).examples] == ["5", "1250", "0.5"]


# ---------------------------------------------------------------- held-out evaluation under the failure-rate rule
RUN = TINY + ["train.steps=2", "threads=1"]


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory, cache):
    """Scorers importable by the CLI's processes, and the tiny base built beforehand (``runproc.cache``), so
    that stderr holds no progress bar of its build."""
    root = tmp_path_factory.mktemp("scorers")
    (root / "tb_returns.py").write_text(SCORERS)
    (root / "tb_exits.py").write_text("import os\n\ndef score(c, r):\n    os._exit(3)\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "TRUSTBATCH_CACHE": str(cache)}


def test_string_reward_stops_the_run_at_the_base_evaluation_with_one_line(tmp_path, cli_env):
    # the held-out evaluation before round 1 applies the rounds' rule; without it the run would stop at round 1
    run = tmp_path / "run"
    rc, lines, _ = _cli(["train", *RUN, "reward.name=tb_returns:as_string", f"run_dir={run}"], cli_env)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("trustbatch: error: held-out evaluation at round 0: reward 'tb_returns:as_string' "
                               "failed on ")
    assert "reward.max_failure_rate=0.5" in lines[0] and "the scorer returned str '0.75'" in lines[0]
    assert not (run / "metrics.jsonl").exists() or "reward_mean" not in (run / "metrics.jsonl").read_text()


@pytest.mark.parametrize("workers, completion", [(2, "hang"), (0, "raise")])
def test_a_call_stops_scoring_once_the_rule_is_certain(workers, completion):
    # 20 completions at rate 0.5: the verdict is certain at the 11th failure; each worker may add one
    # more failure in the same wait, so at most 10 + workers fail, and the rest are left unscored
    with RewardPool("scorers_for_tests:misbehave", workers=workers, timeout_s=0.3) as pool:
        res = pool.score([completion] * 20, ["x"] * 20, max_failure_rate=0.5)
        assert 11 <= res.errors + res.timeouts <= 10 + max(workers, 1)
        assert res.errors + res.timeouts + res.unscored == 20 and res.rewards == [0.0] * 20
        with pytest.raises(UserError, match=r"in 20 completions, \d+ of them left unscored\), above reward"):
            check_scoring(res, scorer="s", max_failure_rate=0.5, where="held-out evaluation at round 0")
        # the pool still scores after a stop (its busy workers were replaced), and a call under the rate runs out
        again = pool.score(["a", completion, "a", "b"], ["a"] * 4, max_failure_rate=0.5)
        assert again.rewards == [1.0, 0.0, 1.0, 0.0] and again.unscored == 0
        assert again.errors + again.timeouts == 1


# ---------------------------------------------------------------- reward.workers=0: said at start, a death explained
def test_scorer_exit_in_process_is_explained_by_the_next_start(tmp_path, cli_env):
    run = tmp_path / "run"
    rc, lines, out = _cli(["train", *RUN, "reward.name=tb_exits:score", "reward.workers=0", f"run_dir={run}"], cli_env)
    assert rc == 3 and lines == []  # os._exit(3): no Python code runs after it, not even atexit
    (said,) = [l for l in out.splitlines() if "reward.workers=0" in l]
    assert said.startswith("warning: reward.workers=0 scores in the trainer's process") and "exits or hangs" in said
    assert (run / "scoring_in_process.json").exists()
    rc, lines, out = _cli(["train", "--resume", str(run), "reward.workers=2"], cli_env)
    (died,) = [l for l in out.splitlines() if "last start" in l]
    assert died.startswith("warning: the last start of this run (pid ") and "'tb_exits:score'" in died
    assert "reward.workers=0" in died and "os._exit" in died
    assert not (run / "scoring_in_process.json").exists()
    # the scorer still exits, now in worker processes: counted, and stopped by the rule with one line
    assert rc == 2 and len(lines) == 1 and "the scorer's process died (exit code 3)" in lines[0], lines


@pytest.mark.parametrize("completion", ["a", "raise"])
def test_in_process_marker_is_gone_after_a_call_that_returns(tmp_path, completion):
    marker = tmp_path / "m.json"
    with RewardPool("scorers_for_tests:misbehave", workers=0) as pool:
        pool.in_process_marker = marker
        seen = []
        pool._local = lambda c, r: seen.append(marker.exists()) or 1.0  # the scorer sees the marker in place
        pool.score([completion], ["a"])
    assert seen == [True] and not marker.exists()
    from trustbatch.rewards.pool import read_in_process_marker

    assert read_in_process_marker(marker) is None
    marker.write_text('{"pid": 12')  # cut short by the death it reports
    assert read_in_process_marker(marker).startswith("warning: the last start of this run (pid ?)")
    assert not marker.exists()


def test_padding_free_with_the_exact_kl_passes_the_preflight():
    """The packed learner rebuilds the behaviour distribution in its own layout (tests/unit/test_packed_exact_kl.py):
    the start-up check lets the pair through, with the top-p refusal still in front of it."""
    from trustbatch.errors import UserError
    from trustbatch.recipes.checks import check_objective

    check_objective(load_config(None, ["train.padding_free=true", "objective.options={kl: exact}"]))
    check_objective(load_config(None, ["train.padding_free=true"]))  # k3, the default, packs
    with pytest.raises(UserError, match=r"top-p sampling"):
        check_objective(load_config(None, ["train.padding_free=true", "objective.options={kl: exact}",
                                           "rollout.top_p=0.9"]))


def test_async_exact_kl_at_a_recorded_precision_is_one_line_exit_2(tmp_path):
    """Rollout workers at bfloat16: teacher forcing the pushed weights would not rebuild what they sampled, and they
    send no recorded distribution; refused in one line before the run directory exists (float32 async runs:
    tests/integration/test_async_exact_kl.py). vLLM workers send their top-k log-probs with each batch: accepted,
    process workers and Ray's with the learner in the driver (the run: tests/integration/test_vllm_train.py)."""
    from trustbatch.recipes.checks import check_objective

    for where in ([], ["orchestrator=ray", "ray_learners=0"]):
        check_objective(load_config(None, ["rollout.mode=async", "rollout.engine=vllm", *where,
                                           "objective.options={kl: exact}"]))
    rc, lines, _ = _cli(["train", *TINY, "train.steps=1", "threads=1", "rollout.mode=async", "rollout.precision=bfloat16",
                         "objective.options={kl: exact}", f"run_dir={tmp_path / 'run'}"],
                        {"TRUSTBATCH_CACHE": str(tmp_path / "cache")})
    assert rc == 2 and len(lines) == 1, lines
    assert "rollout.mode=async rebuilds each batch's behaviour" in lines[0] and "rollout.precision=float32" in lines[0]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the reference KL's reference
def test_what_the_reference_kl_cannot_use_is_refused_in_one_line(tmp_path):
    """model.reference without a reference KL would be ignored; a path that is no model directory would fail after
    the policy loaded; Ray learner actors hold no reference: each is one line at the preflight, before any model
    loads. The reference KL itself (and the entropy bonus) passes."""
    from trustbatch.recipes.build import preflight

    ref_kl = "objective.options={ref_kl_coef: 0.04}"
    for overrides, says in (
            ([f"model.reference={tmp_path}"], "model.reference is the reference KL's model"),
            ([ref_kl, f"model.reference={tmp_path / 'none'}"], "is not a local Hugging Face model directory"),
            ([ref_kl, "rollout.mode=async", "orchestrator=ray", "ray_learners=2"], "does not run with Ray learner")):
        with pytest.raises(UserError) as e:
            preflight(load_config(None, overrides))
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    preflight(load_config(None, ["objective.options={ref_kl_coef: 0.04, entropy_coef: 0.01}"]))
    preflight(load_config(None, ["objective.name=grpo", "objective.options={ref_kl_coef: 0.04, ref_kl: k2}"]))


def test_a_reference_with_another_tokenizer_is_refused_in_one_line(shared_dir):
    from trustbatch.policy import Policy
    from trustbatch.policy.model import build_small_llama
    from trustbatch.policy.tokenizer import train_tokenizer
    from trustbatch.recipes.build import reference_policy

    tok = train_tokenizer(["1 + 2 = 3", "4 - 1 = 3"], vocab_size=300)
    policy = Policy(build_small_llama(len(tok), hidden=16, layers=1, heads=2, max_len=32, seed=0, tokenizer=tok), tok,
                    tok.eos_token_id, tok.pad_token_id)
    other = shared_dir / "models" / "stories260K-hf"
    cfg = load_config(None, ["objective.options={ref_kl_coef: 0.04}", f"model.reference={other}"])
    with pytest.raises(UserError, match="has another tokenizer or vocabulary") as e:
        reference_policy(cfg, policy)
    assert "\n" not in str(e.value)
    assert reference_policy(load_config(None, ["objective.options={entropy_coef: 0.01}"]), policy) is None
