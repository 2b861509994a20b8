"""The ``math`` reward: the final answer (the last ``\\boxed{}``, else math-verify's own reading of the
completion) checked by math-verify.

math-verify (https://github.com/huggingface/Math-Verify) decides equivalence symbolically and
numerically (fractions, intervals, tuples, sets, units). It parses LaTeX only between math
delimiters, so both the gold answer and a boxed prediction are wrapped in ``$…$``. Without a box, the
whole completion goes to math-verify's ``parse`` (its "final answer is" patterns, then the last LaTeX or
plain expression), as TRL's and verl's math-verify rewards do: the last digits of the text would read
``$\\frac{14}{3}$`` as 3 and ``$\\sqrt{2}$`` as 2.
"""

from __future__ import annotations

import re
from decimal import Decimal

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# the minus signs of Unicode text (U+2212, and the small and fullwidth hyphen-minus), read as ASCII's
_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
# a number bound to a root, fraction or power (``√2``, ``π/4``, ``3/π``, ``2^3``) is not an answer on its own; a
# slash after it followed by a word is a rate (``$15/hour``, GSM8K's answers), not a fraction
_BOUND_BEFORE = "√∛∜/^"
_BOUND_AFTER = "^√∛∜π"
_DENOMINATOR = "√∛∜π\\"  # what after a slash makes the number before it a numerator


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")


def _last_box(text: str) -> re.Match | None:
    found = list(_BOX.finditer(text))
    return found[-1] if found else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) with balanced braces, or the one token of
    ``\\boxed 5``; None if there is none or it was cut off."""
    box = _last_box(text)
    if box is None:
        return None
    i = box.end()
    if not text.startswith("{", i):
        # \boxed 5 (no braces) is valid LaTeX for one token; a brace further on belongs to something else
        m = re.match(r"[^\s{}$]+", text[i:])
        return (m.group().rstrip(".,") or None) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the completion was cut


def minus_as_ascii(text: str) -> str:
    """``text`` with Unicode minus signs (``−3``) written as ASCII's ``-``."""
    return text.translate(_MINUS)


def last_number(text: str) -> str | None:
    """The last number in ``text`` with thousands separators removed (``1,000`` → ``1000``) and a Unicode minus
    read as ``-`` (``−3`` → ``-3``); None if none, or if that number is part of a root, fraction or power
    (``√2``, ``π/4``, ``3/π``, ``3/\\pi``, ``2^3``, ``2π``): the fallback would otherwise reward ``√2`` for the
    answer 2. A number before a slash and a word is a rate's, and read (``$15/hour``, ``2/n``)."""
    text = minus_as_ascii(text)
    found = list(_NUMBER.finditer(text))
    if not found:
        return None
    last = found[-1]
    rest = text[last.end():].lstrip()
    before, after = text[:last.start()].rstrip()[-1:], rest[:1]
    over = rest[1:].lstrip()[:1] if after == "/" else ""
    if (before and before in _BOUND_BEFORE) or (after and after in _BOUND_AFTER) or (over and over in _DENOMINATOR):
        return None
    return last.group().replace(",", "").rstrip(".")


def _unbold(ans: str) -> str:
    """``\\textbf{(073)}`` → ``073``: AoPS-style bold answer choices that math-verify does not parse."""
    ans = re.sub(r"\\textbf\{([^{}]*)\}", r"\1", ans).strip()
    m = re.fullmatch(r"\(\s*(-?[\d.]+)\s*\)", ans)
    return m.group(1) if m else ans


def extract_answer(completion: str) -> str | None:
    """The text math-verify reads as the model's final answer: the last ``\\boxed{}``'s content between ``$…$``;
    None when that box is cut off (an unfinished answer); else the whole completion, its escaped dollar signs
    (``\\$18``, MATH's money) dropped, which math-verify's patterns skip. An empty box (``\\boxed{}`` echoed from
    an instruction) counts as none."""
    if _last_box(completion) is not None:
        boxed = extract_boxed(completion)
        if boxed is None:
            return None
        if boxed.strip():
            return f"${_unbold(boxed)}$"
    return completion.replace("\\$", "")


def gold_text(answer) -> str:
    """A gold answer as text; JSON numbers such as AMC's ``27.0`` become ``27``, and a small or large float is
    written positionally (``1e-05`` → ``0.00001``: math-verify reads ``1e-05`` as ``1·e − 5``, Euler's e)."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, float) and "e" in repr(answer):
        return format(Decimal(repr(answer)), "f")
    return str(answer).strip()


def math_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``reference`` (LaTeX or a number), else 0.0.

    Extraction (``extract_answer``): the last ``\\boxed{…}``, else math-verify's ``parse`` of the whole completion,
    else (math-verify reads nothing there) its last number; a cut-off last box, or no answer, gives 0.
    Raises whatever math-verify raises on pathological input; the reward pool turns that into 0.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(f"${reference}$", extraction_config=configs)
    # math-verify reads nothing in some plain texts (a number its patterns do not match): the last number then
    got = parse(pred, extraction_config=configs) or (
        parse(f"${n}$", extraction_config=configs) if not pred.startswith("$") and (n := last_number(pred)) else [])
    if not gold or not got:
        return 0.0
    return 1.0 if verify(gold, got) else 0.0


def _import_math_verify() -> None:
    import math_verify  # noqa: F401 - sympy and its parsers: about 0.6 s, once per process


# called by a reward worker before its first completion, so its time limit never pays for the import
math_reward.warm_up = _import_math_verify
