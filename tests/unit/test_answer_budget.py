"""Issue 37 (item 7): long-answer benchmarks get a completion budget that fits, and heavy truncation is warned of.

The budgets are the peers' (verl: GSM8K 512, MATH 1024; verl's DAPO recipe on AIME: 20480), written out here.
"""

import io
from types import SimpleNamespace
import json

import pytest
from rich.console import Console

from trustbatch.config import dump_config, load_config
from trustbatch.data.benchmarks import benchmark_kind
from trustbatch.recipes.defaults import with_answer_budget
from trustbatch.recipes.hooks import TrainHooks


@pytest.mark.parametrize("name,kind", [("gsm8k", "gsm8k"), ("math500", "math"), ("aime2024", "aime"),
                                       ("amc2023", "amc"), ("countdown", "countdown")])
def test_the_shared_benchmarks_are_recognised(shared_dir, name, kind):
    assert benchmark_kind(name, str(shared_dir / "data")) == kind
    assert benchmark_kind(str(shared_dir / "data" / name / "test.jsonl")) == kind


@pytest.mark.parametrize("form", ["parquet", "json", "datasets"])
def test_tables_are_recognised_as_their_jsonl_is(shared_dir, tmp_path, form):
    """GSM8K rows as Parquet, a JSON array or a saved ``datasets`` directory are gsm8k, as they load (the first
    line of such a file is no JSON row: they were None, and a run on them kept the 8-token default budget)."""
    import datasets

    rows = [json.loads(l) for l in (shared_dir / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[:5]]
    path = tmp_path / {"parquet": "rows.parquet", "json": "rows.json", "datasets": "rows"}[form]
    if form == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif form == "json":
        path.write_text(json.dumps(rows))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    assert benchmark_kind(str(path)) == "gsm8k"


def test_a_file_that_is_no_benchmark_or_unreadable_is_none(tmp_path):
    plain = tmp_path / "mine.jsonl"
    plain.write_text(json.dumps({"q": "2+2", "a": "4"}) + "\n")
    assert benchmark_kind(str(plain)) is None
    assert benchmark_kind(str(tmp_path / "missing.jsonl")) is None
    assert benchmark_kind(str(plain), format="math") == "math"  # a format given by the user is taken


def _model(tmp_path, context: int) -> str:
    d = tmp_path / f"model{context}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": context}))
    return str(d)


def _math_file(tmp_path, name: str) -> str:
    f = tmp_path / f"{name}.jsonl"
    f.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    return str(f)


@pytest.mark.parametrize("name,context,budget", [("competition_math", 32768, 1024), ("aime25", 65536, 20480), ("aime25", 32768, 16384),
                                                 ("amc_12", 4096, 2048), ("aime25", 2048, 1024)])
def test_an_unset_budget_fits_the_benchmark_and_half_the_context(tmp_path, name, context, budget):
    cfg = load_config(None, [f"data.train={_math_file(tmp_path, name)}", f"model.path={_model(tmp_path, context)}"])
    out, note = with_answer_budget(cfg)
    assert out.rollout.max_new_tokens == budget
    assert f"rollout.max_new_tokens={budget}" in note and "\n" not in note
    # what config.yaml records is what a resume reads back
    assert load_config(None, [], base=json.loads(json.dumps(out.model_dump(mode="json")))).rollout.max_new_tokens == budget
    assert f"max_new_tokens: {budget}" in dump_config(out)


def test_gsm8k_gets_512(shared_dir, tmp_path):
    cfg = load_config(None, [f"data.train={shared_dir / 'data' / 'gsm8k' / 'train.jsonl'}",
                             f"model.path={_model(tmp_path, 32768)}"])
    assert with_answer_budget(cfg)[0].rollout.max_new_tokens == 512


@pytest.mark.parametrize("extra", [["rollout.max_new_tokens=8"], ["rollout.max_new_tokens=64"], []])
def test_a_budget_the_user_set_or_the_default_task_is_left_alone(tmp_path, extra):
    data = [f"data.train={_math_file(tmp_path, 'aime')}", f"model.path={_model(tmp_path, 32768)}"] if extra else []
    cfg = load_config(None, data + extra)
    out, note = with_answer_budget(cfg)
    assert out is cfg and note is None


def _hooks(console) -> TrainHooks:
    """Hooks whose policy encodes a prompt as one token a character, in a context of 64, over prompts of 4 and 10."""
    cfg = load_config(None, ["rollout.max_new_tokens=16"])
    policy = SimpleNamespace(encode_prompt=lambda p: [0] * len(p),
                             model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64)))
    task = SimpleNamespace(train=[SimpleNamespace(prompt="a" * 4), SimpleNamespace(prompt="b" * 10)])
    return TrainHooks(cfg, None, None, policy, task, None, None, None, None, console)


def test_truncation_past_20_percent_is_warned_once_in_one_line():
    buf = io.StringIO()
    hooks = _hooks(Console(file=buf, force_terminal=False, width=40))
    hooks.warn_truncation(1, {"truncated_fraction": 0.1})
    hooks.warn_truncation(2, {"truncated_fraction": 0.2})  # at 20%: not past it
    hooks.warn_truncation(3, {"reward_mean": 0.5})
    assert buf.getvalue() == ""
    hooks.warn_truncation(4, {"truncated_fraction": 0.25})
    hooks.warn_truncation(5, {"truncated_fraction": 0.9})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 and "round 4" in lines[0] and "25%" in lines[0] and "rollout.max_new_tokens=16" in lines[0]
    assert "raise rollout.max_new_tokens (up to 54 keeps every prompt" in lines[0]  # 64 - the longest prompt, 10


def test_countdown_gets_a_budget_its_gold_answers_fit(shared_dir):
    """Countdown kept the default 8 tokens: its shortest bare answer is 9 tokens of stories260K's, and the
    demonstration its prompt asks for (<answer> ... </answer>) 29-32, so every completion was cut and scored 0. The
    reference: the data's own scorer on each row's gold demonstration, cut at the run's budget."""
    from trustbatch.data.benchmarks import load_benchmark
    from trustbatch.policy import load_policy
    from trustbatch.recipes.train import resolved_config
    from trustbatch.rewards import get

    model, path = shared_dir / "models" / "stories260K-hf", shared_dir / "data" / "countdown" / "test.jsonl"
    budget = resolved_config(None, [f"data={path}", f"model.path={model}"]).rollout.max_new_tokens
    assert budget == 256  # 1024 (TinyZero's), at most half of stories260K's 512 positions
    policy, bench = load_policy(str(model)), load_benchmark(str(path))
    score = get(bench.reward)
    cut = [score(policy.decode(policy.encode_completion(" " + e.answer)[:budget]), e.reference)
           for e in bench.examples]
    assert len(cut) == 256 and sum(cut) == 256


def test_a_jsonl_file_with_a_byte_order_mark_reads_as_without(shared_dir, tmp_path):
    """A UTF-8 byte-order mark before the first row (Windows editors) was refused as "line 1 is not valid JSON
    (Unexpected UTF-8 BOM)", and the file was no benchmark (the 8-token budget). Reference: the same file without."""
    from trustbatch.data.benchmarks import load_benchmark

    plain = shared_dir / "data" / "gsm8k" / "test.jsonl"
    marked = tmp_path / "test.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert benchmark_kind(str(marked)) == "gsm8k"
    assert load_benchmark(str(marked)).examples == load_benchmark(str(plain)).examples
