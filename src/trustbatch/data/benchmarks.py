"""Benchmarks and training data from local JSONL files: GSM8K, MATH/MATH-500, AIME, AMC, Countdown, any JSONL.

The format is detected from the first row's fields, or named:
- ``gsm8k``: ``question`` and ``answer`` ending in ``#### N`` (openai/grade-school-math);
- ``math``: ``problem`` and ``answer`` (MATH-500, AIME, AMC; a ``solution`` is used as the SFT demonstration);
- ``countdown``: ``input`` (comma-separated numbers) and ``output`` (the target) (TinyZero / d1);
- ``jsonl``: any rows, with ``prompt_field`` and ``answer_field`` named by the user (math reward by default).

Each format brings its prompt instruction and its default reward. Names such as ``gsm8k`` or
``math500`` resolve to ``DATA_DIR/<name>/test.jsonl`` (``--data-dir`` or ``$TRUSTBATCH_DATA``);
``hf:PATH[:CONFIG]:SPLIT`` loads a ``datasets`` split where a hub is reachable.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .tasks import Example

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_INSTRUCTION = "\nLet's think step by step and output the final answer after \"####\"."
COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can be used at most once. Return the final equation in "
    "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
REWARD_OF_FORMAT = {"gsm8k": "gsm8k", "math": "math", "countdown": "countdown", "jsonl": "math"}
KNOWN = {  # benchmark name -> file under the data directory
    "gsm8k": "gsm8k/test.jsonl", "math500": "math500/test.jsonl", "aime2024": "aime2024/test.jsonl",
    "aime24": "aime2024/test.jsonl", "amc2023": "amc2023/test.jsonl", "amc23": "amc2023/test.jsonl",
    "countdown": "countdown/test.jsonl",
}


@dataclass
class Benchmark:
    name: str
    format: str  # gsm8k | math | countdown | jsonl
    reward: str  # default scorer name for trustbatch.rewards.get
    examples: list[Example]


def detect_format(row: dict) -> str:
    """The format of a row from its fields; UserError if no known format fits."""
    if "question" in row and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return "gsm8k"
    if "problem" in row and "answer" in row:
        return "math"
    if "input" in row and "output" in row and re.fullmatch(r"\s*-?\d+(\s*,\s*-?\d+)+\s*", str(row["input"])):
        return "countdown"
    raise UserError(
        f"cannot tell the format of a row with fields {sorted(row)}; pass format=jsonl with "
        "prompt_field=... and answer_field=..."
    )


def _clean_gsm8k_solution(text: str) -> str:
    return re.sub(r"<<[^>]*>>", "", text)  # the dataset's calculator annotations


def to_example(row: dict, fmt: str, prompt_field: str | None = None, answer_field: str | None = None) -> Example:
    """One row as an Example: the prompt with its format's instruction, the scorer's reference, a demonstration."""
    from ..rewards.countdown import solve
    from ..rewards.gsm8k import gsm8k_answer
    from ..rewards.math_answer import gold_text

    if fmt == "gsm8k":
        gold = gsm8k_answer(row["answer"]) or ""
        return Example(row["question"] + GSM8K_INSTRUCTION, gold, _clean_gsm8k_solution(row["answer"]))
    if fmt == "math":
        gold = gold_text(row["answer"])
        demo = row.get("solution") or ""
        if "\\boxed" not in demo:  # AIME solutions often end without one; the demo must show the format
            demo = (demo + "\n" if demo else "") + f"The final answer is $\\boxed{{{gold}}}$."
        return Example(row["problem"] + MATH_INSTRUCTION, gold, demo)
    if fmt == "countdown":
        numbers = [int(x) for x in str(row["input"]).split(",")]
        target = int(row["output"])
        expr = solve(numbers, target)
        ref = json.dumps({"numbers": numbers, "target": target})
        return Example(COUNTDOWN_PROMPT.format(numbers=numbers, target=target), ref,
                       f"<answer> {expr} </answer>" if expr else "<answer> </answer>")
    if fmt == "jsonl":
        pf, af = prompt_field or "prompt", answer_field or "answer"
        if pf not in row or af not in row:
            raise UserError(f"a row lacks field {pf if pf not in row else af!r} (fields: {sorted(row)}); "
                            "set prompt_field=... and answer_field=...")
        return Example(str(row[pf]), gold_text(row[af]), str(row[af]))
    raise UserError(f"unknown data format {fmt!r}; use auto, gsm8k, math, countdown or jsonl")


def resolve(name_or_path: str, data_dir: str | None = None) -> Path:
    """A benchmark name (``gsm8k``, ``math500``, ``aime2024``, ``amc2023``, ``countdown``) or a file path → the file."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if name_or_path in KNOWN:
        root = data_dir or os.environ.get("TRUSTBATCH_DATA")
        if root is None:
            raise UserError(f"benchmark {name_or_path!r} needs its data: pass --data-dir DIR (holding "
                            f"{KNOWN[name_or_path]}) or set TRUSTBATCH_DATA, or give the file path")
        f = Path(root).expanduser() / KNOWN[name_or_path]
        if not f.is_file():
            raise UserError(f"benchmark {name_or_path!r}: {str(f)!r} does not exist; check --data-dir / TRUSTBATCH_DATA")
        return f
    raise UserError(f"{name_or_path!r} is neither a file nor a known benchmark ({', '.join(sorted(KNOWN))})")


def _read_rows(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{str(path)!r} line {n} is not valid JSON ({e.msg}); the file must be JSON Lines") from None
            if not isinstance(row, dict):
                raise UserError(f"{str(path)!r} line {n} is not a JSON object")
            rows.append(row)
    if not rows:
        raise UserError(f"{str(path)!r} holds no rows")
    return rows


def _hub_rows(spec: str) -> list[dict]:
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise UserError(f"hub benchmark {'hf:' + spec!r} must look like hf:PATH:SPLIT or hf:PATH:CONFIG:SPLIT")
    try:
        import datasets
    except ImportError:
        raise UserError("hf: benchmarks need the `datasets` package (pip install datasets)") from None
    path, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    try:
        return [dict(r) for r in datasets.load_dataset(path, config, split=split)]
    except Exception as e:  # offline hub, unknown name: one line, not a traceback
        raise UserError(f"cannot load {'hf:' + spec!r} from the hub: {str(e).splitlines()[0]}") from None


def load_benchmark(name_or_path: str, *, data_dir: str | None = None, format: str = "auto",
                   prompt_field: str | None = None, answer_field: str | None = None,
                   limit: int | None = None) -> Benchmark:
    """Load a benchmark or training file into Examples.

    Raises:
        UserError: missing file, invalid JSON, unknown format or missing fields.
    """
    if name_or_path.startswith("hf:"):
        rows, name = _hub_rows(name_or_path[3:]), name_or_path
    else:
        path = resolve(name_or_path, data_dir)
        rows = _read_rows(path)
        name = name_or_path if name_or_path in KNOWN else path.parent.name if path.stem in ("test", "train") else path.stem
    if limit is not None:
        rows = rows[:limit]
    fmt = format
    if fmt == "auto":
        fmt = "jsonl" if prompt_field or answer_field else detect_format(rows[0])
    examples = [to_example(r, fmt, prompt_field, answer_field) for r in rows]
    return Benchmark(name=name, format=fmt, reward=REWARD_OF_FORMAT.get(fmt, "math"), examples=examples)


def load_file_task(data_cfg) -> "TaskSplit":
    """A train/held-out split from ``data.train`` (and ``data.heldout``), disjoint by prompt text.

    Without a held-out file the first ``heldout_size`` distinct train rows are held out. Raises
    UserError when nothing is left to train on.
    """
    from .tasks import TaskSplit

    kw = dict(data_dir=data_cfg.dir, format=data_cfg.format, prompt_field=data_cfg.prompt_field,
              answer_field=data_cfg.answer_field)
    train = load_benchmark(data_cfg.train, **kw)
    seen: set[str] = set()
    pool = [e for e in train.examples if not (e.prompt in seen or seen.add(e.prompt))]
    if data_cfg.heldout:
        heldout = load_benchmark(data_cfg.heldout, limit=data_cfg.heldout_size, **kw).examples
        held = {e.prompt for e in heldout}
        rest = [e for e in pool if e.prompt not in held]
    else:
        heldout, rest = pool[:data_cfg.heldout_size], pool[data_cfg.heldout_size:]
    rest = rest[:data_cfg.train_size] if data_cfg.train_size else rest
    if not rest:
        raise UserError(f"{data_cfg.train!r} has no rows left for training after holding out {len(heldout)}; "
                        "lower data.heldout_size or give data.heldout=FILE")
    return TaskSplit(name=train.name, reward=train.reward, train=rest, heldout=heldout)
