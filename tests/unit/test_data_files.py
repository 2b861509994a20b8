"""Data in the formats people have: Parquet, JSON and saved ``datasets`` directories, with the JSONL path's format
detection and field mapping, and one line naming the file and the cause for a bad one.

Independent references: the prompts and references written out by hand from each format's rule (benchmarks'
module docstring), and the same rows read from a JSONL file (the pinned path)."""

import json
import sys

import pytest

import datasets  # noqa: E402 - a core dependency: a datasets that fails to import fails here, not skips
import pyarrow as pa  # noqa: E402  (comes with datasets)
import pyarrow.parquet as pq  # noqa: E402

from trustbatch.data.benchmarks import MATH_INSTRUCTION, load_benchmark, load_file_task  # noqa: E402
from trustbatch.config import load_config  # noqa: E402
from trustbatch.errors import UserError  # noqa: E402

ROWS = [{"problem": f"What is {i} + {i + 1}?", "answer": 2 * i + 1} for i in range(12)]
GSM = [{"question": "Tom has 3 pens and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """load_dataset keeps an Arrow copy of each file: in the test's folder, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_json_and_datasets_directories_give_the_jsonl_examples(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ref = load_benchmark(str(jsonl))
    # by hand: MATH format, the instruction appended, the integer answer as the reference
    assert ref.format == "math" and ref.examples[3].prompt == "What is 3 + 4?" + MATH_INSTRUCTION
    assert ref.examples[3].reference == "7"
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "lines.json").write_text(jsonl.read_text())  # datasets' to_json writes JSON Lines
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(str(tmp_path / "one_split"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:2]), test=datasets.Dataset.from_list(ROWS)
                         ).save_to_disk(str(tmp_path / "splits"))
    paths = [_parquet(tmp_path / "rows.parquet", ROWS), tmp_path / "rows.json", tmp_path / "lines.json",
             tmp_path / "saved", tmp_path / "one_split", tmp_path / "splits" / "test"]
    for p in paths:
        b = load_benchmark(str(p))
        assert (b.format, b.reward, b.examples) == (ref.format, ref.reward, ref.examples), p
    assert [load_benchmark(str(p)).name for p in paths[3:]] == ["saved", "one_split", "splits"]


def test_format_detection_and_field_mapping_on_parquet(tmp_path):
    gsm = load_benchmark(str(_parquet(tmp_path / "gsm.parquet", GSM)))
    assert gsm.format == "gsm8k" and gsm.examples[0].reference == "7"
    assert gsm.examples[0].answer == "3 + 4 = 7\n#### 7"  # calculator annotations dropped
    rows = [{"q": "Name a colour.", "a": "red", "extra": [1, 2]}]
    plain = load_benchmark(str(_parquet(tmp_path / "plain.parquet", rows)), prompt_field="q", answer_field="a")
    assert plain.format == "jsonl" and plain.examples[0].prompt == "Name a colour."
    assert plain.examples[0].reference == "red"


def test_train_and_heldout_from_a_parquet_file_and_a_datasets_directory(tmp_path):
    train = _parquet(tmp_path / "train.parquet", ROWS)
    datasets.Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "held"))
    cfg = load_config(None, [f"data={train}", f"data.heldout={tmp_path / 'held'}", "data.heldout_size=2"])
    split = load_file_task(cfg.data)
    assert [e.prompt.split("?")[0] for e in split.heldout] == ["What is 0 + 1", "What is 1 + 2"]
    assert len(split.train) == 10 and {e.prompt for e in split.train}.isdisjoint(e.prompt for e in split.heldout)


@pytest.mark.parametrize("name, make, cause", [
    ("junk.parquet", lambda p: p.write_bytes(b"not a parquet file at all"), "as Parquet: ArrowInvalid"),
    ("cut.json", lambda p: p.write_text('[{"problem": "x", "answer": 1},'), "as JSON:"),
    ("plain_dir", lambda p: p.mkdir(), "not a saved datasets directory"),
    ("splits", lambda p: datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(
        ROWS)).save_to_disk(str(p)), "holds the splits train, test; give one split's folder"),
    ("null.parquet", lambda p: _parquet(p, ROWS[:2] + [{"problem": None, "answer": 5}]),
     "row 3: the prompt field 'problem' is null"),
    ("empty.json", lambda p: p.write_text("[]"), "as JSON:"),
    ("unknown.parquet", lambda p: _parquet(p, [{"text": "hello"}]), "row 1: cannot tell the format"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_the_cause(tmp_path, name, make, cause, capfd):
    path = tmp_path / name
    make(path)
    capfd.readouterr()
    with pytest.raises(UserError) as e:
        load_benchmark(str(path))
    msg = str(e.value)
    assert "\n" not in msg and repr(str(path)) in msg and cause in msg, msg
    assert capfd.readouterr().err == ""  # datasets' own error lines and progress bars stay quiet


def test_without_datasets_the_fix_is_to_install_it_or_give_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails and find_spec finds nothing, as when absent
    with pytest.raises(UserError) as e:
        load_benchmark(str(_parquet(tmp_path / "rows.parquet", ROWS)))
    assert str(e.value) == ("Parquet, JSON and datasets directories need the `datasets` package: pip install datasets; "
                            "or give a JSONL file")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_answer_is_null_and_a_numbers_demonstration_is_its_gold_text(tmp_path, bad):
    """pandas writes a missing value as NaN (``df.to_dict("records")``, JSON's ``NaN``): it was read as the gold
    answer "nan", which no completion matches. The demonstration of the answer 5.0 was "5.0" against the reference
    "5"."""
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "What is 2+3?", "answer": 5.0}, {"prompt": "What is 4+4?", "answer": bad}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN / Infinity
    with pytest.raises(UserError) as e:
        load_benchmark(str(path), format="jsonl")
    assert f"{str(path)!r} line 2: the answer field 'answer' is " in str(e.value)
    assert ("null" if bad != bad else "inf") in str(e.value)
    path.write_text(json.dumps(rows[0]) + "\n")
    ex = load_benchmark(str(path), format="jsonl").examples[0]
    assert (ex.reference, ex.answer) == ("5", "5")


def test_a_rows_own_prompt_column_is_its_prompt_as_trl_reads_it(tmp_path):
    """open-r1's rows carry problem, solution, answer and the prompt its script built (a system message and the
    problem), a GSM8K script's rows question, answer and prompt: TRL's GRPOTrainer generates from ``prompt`` alone.
    It was left unread for the MATH/GSM8K prompt with trustbatch's instruction. The answer still gives the reference."""
    from trustbatch.chat import Conversation

    messages = [{"role": "system", "content": "Think in <think> tags."}, {"role": "user", "content": "What is 4+1?"}]
    rows = [{"problem": "What is 4+1?", "solution": "4+1=5", "answer": "5", "prompt": messages},
            {"question": "Tom has 4 apples and gets 1.", "answer": "4+1=5\n#### 5", "prompt": "Tom: how many?"},
            {"input": "1,2,3", "output": "6", "prompt": "Use 1, 2, 3 to make 6."}]
    for row, fmt, ref in zip(rows, ("math", "gsm8k", "countdown"), ("5", "5", '{"numbers": [1, 2, 3], "target": 6}')):
        f = tmp_path / f"{fmt}.jsonl"
        f.write_text(json.dumps(row) + "\n")
        b = load_benchmark(str(f))
        assert (b.format, b.examples[0].reference) == (fmt, ref)
        assert b.examples[0].prompt == (Conversation(messages) if fmt == "math" else row["prompt"])
        assert isinstance(b.examples[0].prompt, Conversation) == (fmt == "math")
    plain = tmp_path / "plain.jsonl"  # without one, the format's own prompt and instruction, as before
    plain.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "prompt"}) + "\n")
    assert load_benchmark(str(plain)).examples[0].prompt == "What is 4+1?" + MATH_INSTRUCTION


def test_held_out_problems_stay_out_of_training_behind_a_prompt_column(tmp_path):
    """Held-out rows were kept out of training by prompt text alone: a training file with TRL's prompt column and a
    held-out file of the same problems without it (MATH-500's rows) trained on every held-out problem, and so did
    one problem under two system messages in one file. Reference: the problems counted by hand."""
    def row(i, system=None):
        r = {"problem": f"What is {i} + 1?", "answer": str(i + 1)}
        if system is not None:
            r["prompt"] = [{"role": "system", "content": system}, {"role": "user", "content": r["problem"]}]
        return r

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(row(i, "Think first.")) + "\n" for i in range(10)))
    held.write_text("".join(json.dumps(row(i)) + "\n" for i in range(3)))
    task = load_file_task(load_config(None, [f"data={train}", f"data.heldout={held}", "data.heldout_size=3"]).data)
    problems = [e.columns["problem"] for e in task.train]
    assert problems == [f"What is {i} + 1?" for i in range(3, 10)]
    both = tmp_path / "both.jsonl"  # each problem twice, behind two system messages, no held-out file
    both.write_text("".join(json.dumps(row(i, s)) + "\n" for i in range(10) for s in ("Think first.", "Be brief.")))
    task = load_file_task(load_config(None, [f"data={both}", "data.heldout_size=4"]).data)
    held_problems = {e.columns["problem"] for e in task.heldout}
    assert len(task.heldout) == 4 and not held_problems & {e.columns["problem"] for e in task.train}


def test_a_repeat_whose_columns_are_both_missing_is_no_other_value(tmp_path, caplog):
    import logging

    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"prompt": "p", "answer": "1", "hint": float("nan"), "n": None}) + "\n"
                         for _ in range(3)))
    with caplog.at_level(logging.WARNING, logger="trustbatch"):
        load_benchmark(str(f))
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "skipped 2 rows" in msg and "0 of them with other values)" in msg


def test_the_fallback_to_questions_asks_each_question_once():
    """One problem behind two system messages falls back to one question, asked once (held-out accuracy counted it
    twice)."""
    from trustbatch.data.benchmarks import questions_in_place

    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1),
             "prompt": [{"role": "system", "content": s}, {"role": "user", "content": f"What is {i} + 1?"}]}
            for i in range(3) for s in ("Think first.", "Be brief.")]
    from trustbatch.data.benchmarks import to_example

    examples, n = questions_in_place([to_example(r, "math") for r in rows])
    assert n == 6 and [e.prompt for e in examples] == [f"What is {i} + 1?" + MATH_INSTRUCTION for i in range(3)]
