"""Benchmarks and training data from local files: GSM8K, MATH/MATH-500, AIME, AMC, Countdown, any rows.

Files are JSON Lines, or Parquet, JSON or a saved ``datasets`` directory (``data.files``); the rows of each go
through the same format detection and field mapping.

The format is detected from the first row's fields, or named:
- ``gsm8k``: ``question`` and ``answer`` ending in ``#### N`` (openai/grade-school-math);
- ``math``: ``problem`` and ``answer`` (MATH-500, AIME, AMC; a ``solution`` is used as the SFT demonstration);
- ``countdown``: ``input`` (comma-separated numbers) and ``output`` (the target) (TinyZero / d1);
- ``jsonl``: any rows (of any file type), with ``prompt_field`` and ``answer_field`` named by the user (math reward by default).

Each format brings its prompt instruction and its default reward. Names such as ``gsm8k`` or
``math500`` resolve to ``DATA_DIR/<name>/test.jsonl`` (``--data-dir`` or ``$TRUSTBATCH_DATA``);
``hf:PATH[:CONFIG]:SPLIT`` loads a ``datasets`` split where a hub is reachable.

Bad rows end the load with a UserError naming the file and line (not UTF-8, not JSON, a missing,
null or empty prompt or answer, an answer the format cannot read, a GSM8K answer whose last ``####``
has no number). They are refused rather than skipped: a skipped row would silently change which
prompts a benchmark's score is over, and the file is the user's to fix. A row whose prompt repeats an
earlier row's is skipped, counted (``Benchmark.duplicates``) and reported by a warning on the
``trustbatch`` logger, so that no prompt counts twice.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..chat import Conversation, conversation, is_messages
from ..errors import UserError
from .files import import_datasets, is_table, read_table
from .tasks import Example

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_INSTRUCTION = "\nLet's think step by step and output the final answer after \"####\"."
COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can be used at most once. Return the final equation in "
    "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
# "prompts": rows of a prompt and no answer (TRL's prompt-only datasets), which have no scorer of their own
NO_SCORER = ""
REWARD_OF_FORMAT = {"gsm8k": "gsm8k", "math": "math", "countdown": "countdown", "jsonl": "math", "prompts": NO_SCORER}
KNOWN = {  # benchmark name -> file under the data directory
    "gsm8k": "gsm8k/test.jsonl", "math500": "math500/test.jsonl", "aime2024": "aime2024/test.jsonl",
    "aime24": "aime2024/test.jsonl", "amc2023": "amc2023/test.jsonl", "amc23": "amc2023/test.jsonl",
    "countdown": "countdown/test.jsonl",
}
log = logging.getLogger("trustbatch.data")

# Completion budgets (tokens) that fit each benchmark's answers, from peers' training configs: verl's GRPO examples
# for GSM8K (examples/grpo_trainer/run_qwen2-7b.sh, data.max_response_length=512) and for GSM8K + MATH
# (run_qwen2-7b_math.sh, 1024), verl's DAPO recipe, validated on AIME 2024 (max_response_length=1024 * 20), and
# TinyZero's Countdown runs (data.max_response_length=1024: its prompt asks for working and <answer> tags)
ANSWER_TOKENS = {"gsm8k": 512, "math": 1024, "aime": 20480, "amc": 20480, "countdown": 1024}


@dataclass
class Benchmark:
    name: str
    format: str  # gsm8k | math | countdown | jsonl
    reward: str  # default scorer name for trustbatch.rewards.get
    examples: list[Example]
    duplicates: int = 0  # rows skipped because their prompt repeats an earlier row's


# the keys that name a plain row's fields, in every command that reads rows
FIELDS_HINT = ("; name the prompt and answer fields: data.prompt_field=... data.answer_field=... "
               "(trustbatch eval: --prompt-field/--answer-field)")


def detect_format(row: dict) -> str:
    """The format of a row from its fields; UserError if no known format fits.

    GSM8K (``question``, ``answer`` ending ``#### N``), MATH (``problem``, ``answer``), Countdown (``input`` numbers,
    ``output``), then plain rows (``prompt``, ``answer``: ``jsonl``), then a prompt alone (``prompts``: TRL's
    prompt-only rows, for reward functions that need no gold answer)."""
    if "question" in row and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return "gsm8k"
    if "problem" in row and "answer" in row:
        return "math"
    if "input" in row and "output" in row and re.fullmatch(r"\s*-?\d+(\s*,\s*-?\d+)+\s*", str(row["input"])):
        return "countdown"
    if "prompt" in row and "answer" in row:  # plain rows, TRL's column name for the prompt
        return "jsonl"
    if "prompt" in row:
        return "prompts"
    raise UserError(f"cannot tell the format of a row with fields {sorted(row)}{FIELDS_HINT}")


def _clean_gsm8k_solution(text: str) -> str:
    return re.sub(r"<<[^>]*>>", "", text)  # the dataset's calculator annotations


def _prompt(row: dict, name: str, hint: str = "") -> str:
    """``row[name]`` as a prompt: a ``chat.Conversation`` for a list of chat messages (TRL's conversational format),
    else text as ``_field`` reads it."""
    if is_messages(row.get(name)):
        return conversation(row[name], f"the prompt field {name!r}")
    return _field(row, name, "prompt", hint)


def _field(row: dict, name: str, what: str, hint: str = "") -> str:
    """``row[name]`` as stripped text; UserError if it is missing, null, empty or not a string or number."""
    if name not in row:
        raise UserError(f"the row has no {what} field {name!r} (fields: {sorted(row)}){hint}")
    v = row[name]
    if is_messages(v):  # TRL's conversational format, read as a prompt alone (``_prompt``)
        raise UserError(f"the {what} field {name!r} is a list of chat messages (TRL's conversational format), which "
                        f"only a prompt may be; give the {what} as text")
    # a float NaN is pandas' missing value (a DataFrame's records, JSON's NaN): null, not the answer "nan"
    missing = v is None or (isinstance(v, float) and not math.isfinite(v))
    if missing or isinstance(v, (bool, dict, list)) or not str(v).strip():
        shown = "null" if v is None or (missing and v != v) else repr(v)
        raise UserError(f"the {what} field {name!r} is {shown}, not text or a number; fix or remove the row")
    return v if isinstance(v, str) else str(v)


def to_example(row: dict, fmt: str, prompt_field: str | None = None, answer_field: str | None = None,
               prompt_column: bool = True) -> Example:
    """One row as an Example: the prompt with its format's instruction, the scorer's reference, a demonstration,
    and the row's fields as ``columns`` (for batch-form reward functions).

    Raises:
        UserError: a missing, null or empty prompt or answer, or an answer the format cannot read
            (GSM8K without ``#### N`` or with an empty last ``####``, Countdown numbers that are not
            integers). The message does not name the file; ``load_benchmark`` adds it.
    """
    return dataclasses.replace(_example(row, fmt, prompt_field, answer_field, prompt_column), columns=dict(row))


def _example(row: dict, fmt: str, prompt_field: str | None, answer_field: str | None,
             prompt_column: bool = True) -> Example:
    # a row's own prompt column (TRL's: open-r1's rows carry problem, solution, answer and the prompt it built) is the
    # prompt as it is, as TRL's GRPOTrainer reads it; the format's fields still give the reference and demonstration
    ex = _format_example(row, fmt, prompt_field, answer_field)
    if fmt not in ("gsm8k", "math", "countdown") or not prompt_column:  # data.prompt_column=false: as before it
        return ex
    return dataclasses.replace(ex, prompt=_prompt(row, "prompt"), question=ex.prompt) if "prompt" in row else ex


def _format_example(row: dict, fmt: str, prompt_field: str | None, answer_field: str | None) -> Example:
    from ..rewards.countdown import solve
    from ..rewards.gsm8k import after_last_hashes, gsm8k_answer
    from ..rewards.math_answer import gold_text

    if fmt == "gsm8k":
        question, answer = _field(row, "question", "prompt"), _field(row, "answer", "answer")
        gold = gsm8k_answer(answer)
        if "####" in answer and after_last_hashes(answer) is None:
            # the scorer's fallback (the last number) would take a number of the worked solution as the gold
            tail = answer[answer.rfind("####"):]
            raise UserError(f"the answer's last '####' is followed by no number ({tail[:40]!r}); GSM8K answers end "
                            "'#### N': fix or remove the row")
        if gold is None:
            raise UserError(f"the answer {answer[-40:]!r} has no final number (GSM8K answers end '#### N'); "
                            "fix the row or read it as MATH (data.format=math; eval: --format math)")
        return Example(question + GSM8K_INSTRUCTION, gold, _clean_gsm8k_solution(answer))
    if fmt == "math":
        problem = _field(row, "problem", "prompt")
        _field(row, "answer", "answer")
        gold = gold_text(row["answer"])  # keeps AMC's 27.0 as 27
        demo = str(row.get("solution") or "")
        if "\\boxed" not in demo:  # AIME solutions often end without one; the demo must show the format
            demo = (demo + "\n" if demo else "") + f"The final answer is $\\boxed{{{gold}}}$."
        return Example(problem + MATH_INSTRUCTION, gold, demo)
    if fmt == "countdown":
        numbers_text, target_text = _field(row, "input", "numbers"), _field(row, "output", "target")
        try:
            numbers = [int(x) for x in numbers_text.split(",")]
            target = int(target_text)
        except ValueError:
            raise UserError(f"Countdown rows need integers: input {numbers_text!r} (comma-separated) and output "
                            f"{target_text!r}; fix the row") from None
        expr = solve(numbers, target)
        ref = json.dumps({"numbers": numbers, "target": target})
        return Example(COUNTDOWN_PROMPT.format(numbers=numbers, target=target), ref,
                       f"<answer> {expr} </answer>" if expr else "<answer> </answer>")
    if fmt == "jsonl":
        pf, af = prompt_field or "prompt", answer_field or "answer"
        hint = FIELDS_HINT
        prompt, answer = _prompt(row, pf, hint), _field(row, af, "answer", hint)
        # a number's demonstration is its gold text: 5, not 5.0
        return Example(prompt, gold_text(row[af]), answer if isinstance(row[af], str) else gold_text(row[af]))
    if fmt == "prompts":  # no gold answer: the reference and the demonstration are empty
        if "answer" in row:  # the first row had none: this one's would be read as a column and scored by nobody
            raise UserError("the row has an answer field 'answer' but the file's first row has none (read as prompts "
                            "alone, data.format=prompts); give every row an answer, or none")
        return Example(_prompt(row, prompt_field or "prompt", FIELDS_HINT), "", "")
    raise UserError(f"unknown data format {fmt!r}; use auto, gsm8k, math, countdown, jsonl or prompts")


def file_format(name_or_path: str, data_dir: str | None = None, format: str = "auto", prompt_field: str | None = None,
                answer_field: str | None = None) -> str | None:
    """The row format ``load_benchmark`` reads a data file in (``format`` unless auto: from its first row, read as
    ``load_benchmark`` reads it), or None when the file cannot be read or no format fits (loading it says why)."""
    if format != "auto":
        return format
    row = first_row(name_or_path, data_dir)
    try:
        return None if row is None else auto_format(row, prompt_field, answer_field)
    except UserError:
        return None


def first_row(name_or_path: str, data_dir: str | None = None) -> dict | None:
    """A data file's first row, read as ``load_benchmark`` reads it, or None when it cannot be read (loading it says
    why)."""
    try:
        path = resolve(name_or_path, data_dir)
        if is_table(path):
            return read_table(path)[0][1]
        with open(path, "rb") as f:
            first = next((line for line in f if line.strip()), b"")
        row = json.loads(first.removeprefix(codecs.BOM_UTF8))
        return row if isinstance(row, dict) else None
    except (UserError, OSError, ValueError, TypeError, IndexError, AttributeError):
        return None


def auto_format(row: dict, prompt_field: str | None = None, answer_field: str | None = None) -> str:
    """``data.format=auto``'s format for a file whose first row is ``row``: plain rows (``jsonl``, or ``prompts``
    without an answer field) when a field is named, else ``detect_format``'s.

    Raises:
        UserError: from ``detect_format``.
    """
    if prompt_field or answer_field:
        return "jsonl" if answer_field or "answer" in row else "prompts"
    return detect_format(row)


def benchmark_kind(name_or_path: str, data_dir: str | None = None, format: str = "auto") -> str | None:
    """Which long-answer benchmark (a key of ``ANSWER_TOKENS``) a data file holds, or None.

    GSM8K and Countdown by their row format; MATH-format rows are AIME or AMC when the name or path says so, else
    MATH. Reads the first row of a JSON Lines file, and a Parquet or JSON file or a ``datasets`` directory as
    ``load_benchmark`` reads it. A file that cannot be read or whose format is unknown gives None (loading it says why).
    """
    format = file_format(name_or_path, data_dir, format)
    if format in ("gsm8k", "countdown"):
        return format
    if format != "math":
        return None
    try:
        path = resolve(name_or_path, data_dir)
    except (UserError, OSError):  # a format given, not read from the file: the file may be missing
        return None
    # the competition as a word of the name given, the file's name or its folder's (aime2024/, amc_23.jsonl), not of
    # any folder above (a user named aimee)
    named = " ".join((name_or_path if name_or_path in KNOWN else "", path.name, path.parent.name)).lower()
    found = re.search(r"(?<![a-z])(aime|amc)(?![a-z])", named)
    return found.group(1) if found else "math"


def resolve(name_or_path: str, data_dir: str | None = None) -> Path:
    """A benchmark name (``gsm8k``, ``math500``, ``aime2024``, ``amc2023``, ``countdown``), a file path or a
    ``datasets`` directory → the path."""
    p = Path(name_or_path).expanduser()
    if p.is_file() or p.is_dir():
        return p
    if name_or_path in KNOWN:
        root = data_dir or os.environ.get("TRUSTBATCH_DATA")
        if root is None:
            raise UserError(f"benchmark {name_or_path!r} needs its data: set data.dir=DIR (trustbatch eval: "
                            f"--data-dir DIR), DIR holding {KNOWN[name_or_path]}, or TRUSTBATCH_DATA, or give the "
                            "file path")
        f = Path(root).expanduser() / KNOWN[name_or_path]
        if not f.is_file():
            raise UserError(f"benchmark {name_or_path!r}: {str(f)!r} does not exist; check data.dir (eval: "
                            "--data-dir) or TRUSTBATCH_DATA")
        return f
    raise UserError(f"{name_or_path!r} is neither a file nor a known benchmark ({', '.join(sorted(KNOWN))})")


def _read_rows(path: Path) -> list[tuple[str, dict]]:
    """``(where, row)`` for each non-blank line, ``where`` being ``"'FILE' line N"``."""
    rows = []
    # a byte-order mark (Windows editors, Excel's "UTF-8" export) starts the first line; json.loads refuses it
    for n, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n"), 1):
        where = f"{str(path)!r} line {n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                            "save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} is not valid JSON ({e.msg}); the file must be JSON Lines") from None
        if not isinstance(row, dict):
            raise UserError(f"{where} is not a JSON object")
        rows.append((where, row))
    if not rows:
        raise UserError(f"{str(path)!r} holds no rows")
    return rows


def _hub_rows(spec: str) -> list[dict]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise UserError(f"hub benchmark {'hf:' + spec!r} must look like hf:PATH:SPLIT or hf:PATH:CONFIG:SPLIT")
    datasets = import_datasets("hf: benchmarks")
    path, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    try:
        return [dict(r) for r in datasets.load_dataset(path, config, split=split)]
    except Exception as e:  # offline hub, unknown name: one line, not a traceback
        raise UserError(f"cannot load {'hf:' + spec!r} from the hub: {str(e).splitlines()[0]}") from None


def load_benchmark(name_or_path: str, *, data_dir: str | None = None, format: str = "auto",
                   prompt_field: str | None = None, answer_field: str | None = None,
                   limit: int | None = None, prompt_column: bool = True) -> Benchmark:
    """Load a benchmark or training file into Examples.

    ``limit`` keeps the first ``limit`` distinct prompts. A row whose prompt repeats an earlier
    row's is skipped and counted in ``duplicates``, with a warning on the ``trustbatch.data`` logger.
    ``prompt_column``: a GSM8K, MATH or Countdown row's ``prompt`` field is its prompt (``data.prompt_column``).

    Raises:
        UserError: missing file, a line that is not UTF-8 or not JSON, a table that does not read (``data.files``), unknown format, a missing,
            null or empty field, an unreadable answer; one line naming the file and line.
    """
    if name_or_path.startswith("hf:"):
        rows = [(f"{name_or_path!r} row {i}", r) for i, r in enumerate(_hub_rows(name_or_path[3:]), 1)]
        name, source = name_or_path, name_or_path
    else:
        path = resolve(name_or_path, data_dir)
        rows = read_table(path) if is_table(path) else _read_rows(path)
        stem = path.name if path.is_dir() else path.stem
        # data/gsm8k/test.jsonl is "gsm8k"; a bare test.jsonl takes the name of the folder it is in, not ""
        name = name_or_path if name_or_path in KNOWN else path.resolve().parent.name if stem in ("test", "train") else stem
        source = str(path)
    fmt = format
    if fmt == "auto":
        try:
            fmt = auto_format(rows[0][1], prompt_field, answer_field)
        except UserError as e:
            raise UserError(f"{rows[0][0]}: {e}") from None
    examples, dups = _distinct_examples(rows, fmt, prompt_field, answer_field, limit, prompt_column)
    if dups:
        differ = [d for _, d in dups if d]
        fields = sorted(set().union(*differ)) if differ else []
        log.warning(f"warning: {source}: skipped {len(dups)} rows whose prompt repeats an earlier row's (the first: "
                    f"{dups[0][0]}; {len(differ)} of them with other values"
                    + (f" of {', '.join(fields[:4])}{', ...' if len(fields) > 4 else ''}, which no reward sees (TRL "
                       "trains on every row)" if differ else "") + f"); {len(examples)} distinct prompts kept")
    return Benchmark(name=name, format=fmt, reward=REWARD_OF_FORMAT.get(fmt, "math"), examples=examples,
                     duplicates=len(dups))


def _distinct_examples(rows: Iterable[tuple[str, dict]], fmt: str, prompt_field: str | None,
                       answer_field: str | None, limit: int | None,
                       prompt_column: bool = True) -> tuple[list[Example], list[tuple[str, set]]]:
    """Examples of the first ``limit`` distinct prompts, and ``(where, the fields whose values differ from the first
    row's)`` of each repeat skipped (``answer`` for the reference)."""
    examples: list[Example] = []
    first: dict[str, Example] = {}
    dups: list[tuple[str, set]] = []
    for where, row in rows:
        if limit is not None and len(examples) >= limit:
            break
        try:
            e = to_example(row, fmt, prompt_field, answer_field, prompt_column)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
        if e.prompt in first:
            was = first[e.prompt]
            differ = {k for k in set(was.columns) | set(e.columns) if not _same(was.columns.get(k), e.columns.get(k))}
            dups.append((where, differ | ({"answer"} if was.reference != e.reference else set())))
            continue
        first[e.prompt] = e
        examples.append(e)
    return examples, dups


def questions_in_place(examples: list[Example]) -> tuple[list[Example], int]:
    """``examples`` with each chat-message prompt that stood in front of its format's question (``Example.question``)
    back to that question, and how many: for a model that cannot frame chat messages. A question already asked by an
    earlier example (one problem behind two system messages) is left out, as a file's repeated prompt is."""
    swap = [isinstance(e.prompt, Conversation) and bool(e.question) for e in examples]
    out, seen = [], set()
    for e, s in zip(examples, swap):
        e = dataclasses.replace(e, prompt=e.question, question="") if s else e
        if e.prompt not in seen:
            seen.add(e.prompt)
            out.append(e)
    return out, sum(swap)


def _same(a, b) -> bool:
    """Two cells of a data column alike: equal, or both missing (None, or NaN: pandas' missing value)."""
    def missing(v):
        return v is None or (isinstance(v, float) and not math.isfinite(v))
    return (missing(a) and missing(b)) or (not missing(a) and not missing(b) and a == b)


def load_file_task(data_cfg) -> "TaskSplit":
    """A train/held-out split from ``data.train`` (and ``data.heldout``), disjoint by prompt text.

    Without a held-out file the first ``heldout_size`` distinct train rows are held out. Repeated
    prompts within a file are skipped with a warning (``load_benchmark``).

    Raises:
        UserError: a bad file or row (see ``load_benchmark``), or nothing left to train on.
    """
    from .tasks import TaskSplit

    kw = dict(data_dir=data_cfg.dir, format=data_cfg.format, prompt_field=data_cfg.prompt_field,
              answer_field=data_cfg.answer_field, prompt_column=data_cfg.prompt_column)
    if data_cfg.train in KNOWN:  # a benchmark's name is its evaluation split: say so before anyone reports on it
        log.warning(f"warning: data.train={data_cfg.train} trains on {KNOWN[data_cfg.train]}, the benchmark's test "
                    f"split: an evaluation on {data_cfg.train} afterwards scores prompts the run trained on; give a "
                    f"training file (data.train=DIR/{Path(KNOWN[data_cfg.train]).parent}/train.jsonl) where one exists")
    train = load_benchmark(data_cfg.train, **kw)
    pool = train.examples  # distinct prompts already
    heldout_reward = None
    if data_cfg.heldout:
        held_file = load_benchmark(data_cfg.heldout, limit=data_cfg.heldout_size, **kw)
        heldout, heldout_reward = held_file.examples, held_file.reward
        rest = pool
    else:
        heldout, rest = pool[:data_cfg.heldout_size], pool[data_cfg.heldout_size:]
    # by prompt, or by the format's question where a prompt column took its place (the same problem behind another
    # system message, or a held-out file without the column)
    held = set().union(*(e.keys for e in heldout))
    rest = [e for e in rest if not e.keys & held]
    rest = rest[:data_cfg.train_size] if data_cfg.train_size else rest
    if not rest and data_cfg.heldout:
        raise UserError(f"{data_cfg.train!r} has no rows left for training: every prompt of it is also in data.heldout "
                        f"{data_cfg.heldout!r}, and held-out prompts are kept out of training; give a held-out file of "
                        "other prompts, or drop data.heldout (the first data.heldout_size train rows are then held out)")
    if not rest:
        raise UserError(f"{data_cfg.train!r} has no rows left for training after holding out {len(heldout)}; "
                        "lower data.heldout_size or give data.heldout=FILE")
    return TaskSplit(name=train.name, reward=train.reward, train=rest, heldout=heldout, heldout_reward=heldout_reward)


def truncate_left(ids: Sequence[int], max_tokens: int | None) -> list[int]:
    """The last ``max_tokens`` of ``ids`` (all of them when shorter, or for None): a long prompt keeps its end, where
    the question is, as TRL's ``max_prompt_length`` truncates (the leftmost tokens, chat template included, go)."""
    ids = list(ids)
    return ids[len(ids) - max_tokens:] if max_tokens is not None and len(ids) > max_tokens else ids


def limit_prompts(prompts: Sequence[Sequence[int]], max_tokens: int,
                  long_prompts: str) -> tuple[list[int], list[list[int]], list[int]]:
    """Apply ``data.max_prompt_tokens`` to encoded prompts: those over ``max_tokens`` are skipped or left-truncated.

    Args:
        prompts: prompt token ids (as encoded for the model, chat template included).
        max_tokens: the limit in tokens, >= 1.
        long_prompts: ``"skip"`` (drop them) or ``"truncate"`` (``truncate_left``: keep their last ``max_tokens``).

    Returns:
        (indices of the prompts kept, in order; their ids after the limit; indices of those truncated).

    Raises:
        ValueError: ``long_prompts`` is neither mode (a caller's bug: the config allows only these).
    """
    if long_prompts not in ("skip", "truncate"):
        raise ValueError(f"long_prompts must be skip or truncate, got {long_prompts!r}")
    long = [i for i, p in enumerate(prompts) if len(p) > max_tokens]
    if long_prompts == "skip":
        keep = [i for i, p in enumerate(prompts) if len(p) <= max_tokens]
        return keep, [list(prompts[i]) for i in keep], []
    return list(range(len(prompts))), [truncate_left(p, max_tokens) for p in prompts], long


def fit_prompts(lengths: Sequence[int], *, context: int | None, max_new_tokens: int,
                where: str) -> tuple[list[int], str | None]:
    """Which prompts leave room for ``max_new_tokens`` in a model's context; the rest are to be skipped.

    A prompt of ``L`` tokens fits when ``L + max_new_tokens <= context``. Beyond the context a
    model's positions are out of its trained range (RoPE) or out of its table (learned positions:
    an index error mid-run), so the caller drops the others and shows the warning.

    Args:
        lengths: prompt lengths in tokens (as encoded for the model, chat template included).
        context: the model's context in tokens (``config.max_position_embeddings``); None: no limit known.
        max_new_tokens: the completion budget in tokens.
        where: what is checked, for the messages (e.g. ``"gsm8k"`` or ``"training data"``).

    Returns:
        (indices of the prompts that fit, in order; a one-line warning naming the count skipped, or None).

    Raises:
        UserError: ``max_new_tokens`` alone fills the context, or no prompt fits.
    """
    if context is None:
        return list(range(len(lengths))), None
    budget = context - max_new_tokens
    if budget < 1:
        raise UserError(f"{where}: max_new_tokens={max_new_tokens} fills the model's context of {context} tokens; "
                        f"lower max_new_tokens (rollout.max_new_tokens or --max-new-tokens) below {context}")
    keep = [i for i, n in enumerate(lengths) if n <= budget]
    skipped = len(lengths) - len(keep)
    if lengths and not keep:
        raise UserError(f"{where}: none of the {len(lengths)} prompts fits in {budget} tokens (the model's context "
                        f"of {context} minus max_new_tokens={max_new_tokens}; the shortest has {min(lengths)}); "
                        "lower max_new_tokens or use a model with a longer context (model.max_len for the "
                        "default base)")
    if not skipped:
        return keep, None
    return keep, (f"warning: {where}: skipped {skipped} of {len(lengths)} prompts longer than {budget} tokens (the "
                  f"model's context of {context} minus max_new_tokens={max_new_tokens}); lower max_new_tokens to "
                  "keep them")
