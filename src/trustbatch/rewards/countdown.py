"""The ``countdown`` reward: an arithmetic expression over the given numbers that equals the target.

Reference: JSON ``{"numbers": [30, 100, 93], "target": 23}``. The completion's expression is the
content of its last ``<answer>…</answer>`` (else its last line); a trailing ``= 23`` is allowed.
It may use ``+ - * /`` (ASCII) and parentheses, and each given number at most once (the rule issue 5 set;
``countdown``). TinyZero's validator and d1's reward, and the shared data's README, ask for every number exactly
once: ``countdown_exact`` (``require_all=True``), whose scores are comparable with theirs.
"""

from __future__ import annotations

import ast
import itertools
import json
import operator
import re
from collections import Counter

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")


def _eval(node) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only integers, + - * / and parentheses are allowed")


def _numbers_used(tree, numbers: Counter) -> Counter:
    """The given numbers an expression uses: each integer literal, and ``-n`` written as a minus before ``n`` where
    ``-n`` is a given number not yet used (Countdown rows may hold negative numbers; ``-3 + 5`` uses the -3)."""
    used: Counter = Counter()
    negated: set[int] = set()  # the literals already counted with their minus (ast.walk visits a parent first)
    for node in ast.walk(tree):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            v = node.operand.value
            if isinstance(v, int) and used[-v] < numbers[-v]:
                used[-v] += 1
                negated.add(id(node.operand))
        elif isinstance(node, ast.Constant) and id(node) not in negated:
            used[node.value] += 1
    return used


def extract_expression(completion: str) -> str | None:
    """The expression in the last ``<answer>…</answer>`` (else the last non-empty line), without ``= target``."""
    tags = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.S)
    text = tags[-1] if tags else next((ln for ln in reversed(completion.splitlines()) if ln.strip()), "")
    expr = text.split("=")[0].strip()
    return expr or None


def countdown_reward(completion: str, reference: str, *, require_all: bool = False) -> float:
    """1.0 if the completion's expression uses each given number at most once and equals the target, else 0.0.

    Division by zero, other characters or a number used too often give 0.0. ``require_all``: every number exactly once.
    """
    ref = json.loads(reference)
    numbers, target = Counter(int(x) for x in ref["numbers"]), float(ref["target"])
    expr = extract_expression(completion)
    if expr is None or not _ALLOWED.match(expr) or "." in expr:
        return 0.0
    try:
        tree = ast.parse(expr, mode="eval")
        used = _numbers_used(tree, numbers)
        if used - numbers or (require_all and used != numbers):
            return 0.0
        value = _eval(tree)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    return 1.0 if abs(value - target) < 1e-6 else 0.0


def countdown_exact_reward(completion: str, reference: str) -> float:
    """``countdown_reward`` with every given number used exactly once (TinyZero's ``validate_equation``, d1's
    Countdown reward): a bare copy of a given number that equals the target scores 0."""
    return countdown_reward(completion, reference, require_all=True)


def solve(numbers: list[int], target: int) -> str | None:
    """An expression using every number once that equals ``target`` (brute force; fine for ≤ 4 numbers), or None.

    Used to build demonstrations for SFT on Countdown data, which ships without solutions.
    """
    def exprs(items):
        if len(items) == 1:
            yield str(items[0][0]), float(items[0][0])
            return
        for i in range(1, len(items)):
            for ls, lv in exprs(items[:i]):
                for rs, rv in exprs(items[i:]):
                    yield f"({ls} + {rs})", lv + rv
                    yield f"({ls} - {rs})", lv - rv
                    yield f"({ls} * {rs})", lv * rv
                    if rv != 0:
                        yield f"({ls} / {rs})", lv / rv

    for perm in itertools.permutations([(n,) for n in numbers]):
        for s, v in exprs(list(perm)):
            if abs(v - target) < 1e-6:
                return s[1:-1] if s.startswith("(") else s
    return None
