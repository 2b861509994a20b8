"""User scorers (``module:function``) that misbehave, for the reward-pool tests."""

import os
import time


def misbehave(completion: str, reference: str) -> float:
    if completion == "hang":
        time.sleep(3600)
    if completion == "die":
        os._exit(3)
    if completion == "raise":
        raise RuntimeError("scorer bug")
    if completion == "nan":
        return float("nan")
    return 1.0 if completion == reference else 0.0


def hang_on_odd_answer(completion: str, reference: str) -> float:
    """Hangs whenever the gold answer is odd (about half of GSM8K's prompts); otherwise 0."""
    if reference.strip()[-1:] in "13579":
        time.sleep(3600)
    return 0.0


def digit_fraction(completion: str, reference: str) -> float:
    """The fraction of characters that are digits: a reward with spread even for an untrained policy."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
