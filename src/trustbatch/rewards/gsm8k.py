"""The ``gsm8k`` reward: the number after the last ``####`` (GSM8K's answer format) equals the gold number."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .math_answer import last_number, minus_as_ascii

# a sign may come before the dollar sign ("#### -$5") as well as after it ("#### $-5")
_AFTER_HASHES = re.compile(r"####\s*(-?)\s*\$?\s*(-?[\d,]*\.?\d+)")


def _signed(sign: str, number: str) -> str:
    """The number of an ``_AFTER_HASHES`` match, commas dropped (``-``, ``1,000`` → ``-1000``)."""
    number = number.replace(",", "")
    return number[1:] if sign and number.startswith("-") else sign + number


def gsm8k_answer(text: str) -> str | None:
    """The answer of a GSM8K-format text: the number after the last ``####``, else the last number.

    ``1,000`` becomes ``1000``; a ``$`` is skipped, before or after a ``-``; a Unicode minus (``−5``) is a ``-``.
    None if the text holds no number.
    """
    text = minus_as_ascii(text)
    found = _AFTER_HASHES.findall(text)
    if found:
        return _signed(*found[-1])
    return last_number(text)


def after_last_hashes(text: str) -> str | None:
    """The number right after the last ``####`` of ``text`` (``1,000`` → ``1000``, a ``$`` skipped).

    None when the text has no ``####`` or its last one is followed by no number (an empty ``#### ``),
    where ``gsm8k_answer`` would fall back to an earlier number.
    """
    text = minus_as_ascii(text)
    at = text.rfind("####")
    found = _AFTER_HASHES.match(text, at) if at >= 0 else None
    return _signed(found.group(1), found.group(2)) if found else None


def _same_number(a: str, b: str) -> bool:
    """Exact decimal equality, so 18 == 18.00 but 1450000 != 1450001 (a relative float tolerance would pass it)."""
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a.strip() == b.strip()


def gsm8k_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's answer equals the reference's, else 0.0.

    ``reference`` is either the bare gold number (``"18"``) or a whole GSM8K solution ending in
    ``#### 18``. The completion's answer is the number after its last ``####``; without ``####``
    the last number counts (the "flexible" match of lm-evaluation-harness).
    """
    gold = gsm8k_answer(reference)
    pred = gsm8k_answer(completion)
    if gold is None or pred is None:
        return 0.0
    return 1.0 if _same_number(pred, gold) else 0.0
