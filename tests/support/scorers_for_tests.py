"""User scorers (``module:function``) that misbehave, for the reward-pool tests."""

import json
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


_hang_calls = 0


def hang_once(completion: str, reference: str) -> float:
    """``digit_fraction``, except that one process hangs for good, once, for the hung-worker test.

    Armed by the file ``$TRUSTBATCH_TEST_HANG_MARKER``: the first process past its
    ``$TRUSTBATCH_TEST_HANG_AFTER``-th call (never ``$TRUSTBATCH_TEST_HANG_SPARE_PID``) that renames
    the file to ``MARKER.<its pid>`` (atomic: one process wins) sleeps forever; the rest score normally.
    """
    global _hang_calls
    _hang_calls += 1
    marker = os.environ.get("TRUSTBATCH_TEST_HANG_MARKER")
    if (marker and _hang_calls > int(os.environ.get("TRUSTBATCH_TEST_HANG_AFTER", "0"))
            and str(os.getpid()) != os.environ.get("TRUSTBATCH_TEST_HANG_SPARE_PID")):
        try:
            os.rename(marker, f"{marker}.{os.getpid()}")
        except FileNotFoundError:  # already claimed
            pass
        else:
            while True:
                time.sleep(3600)
    return digit_fraction(completion, reference)


def column_bonus(prompts, completions, bonus, **columns):
    """TRL's batch form: the data row's ``bonus`` column, for every completion (a reward only the data can give)."""
    return [float(b) for b in bonus]


def column_penalty(prompts, completions, bonus, **columns):
    """TRL's batch form, outside [0, 1] as TRL users' rewards often are (open-r1's length and repetition rewards):
    −2 × the data row's ``bonus`` column."""
    return [-2.0 * float(b) for b in bonus]


def digit_or_penalty(completion: str, reference: str) -> float:
    """Per completion, outside [0, 1]: 2 for a completion with a digit, else a format penalty of −1."""
    return 2.0 if any(c.isdigit() for c in completion) else -1.0


def contains_answer(prompts, completions, reference, **columns):
    """TRL's batch form: 1 when the completion contains the gold answer, 0.25 when the prompt mentions it."""
    return [1.0 if r in c else 0.25 if r in p else 0.0 for p, c, r in zip(prompts, completions, reference)]


def batch_wrong_length(prompts, completions, **columns):
    return [1.0, 1.0]


def even_length(completion: str, reference: str) -> float:
    """1 for a completion of an even number of characters, else 0: a 0/1 reward with spread for any policy (its
    mean is pass@1)."""
    return 1.0 if len(completion) % 2 == 0 else 0.0


def hang_always(completion: str, reference: str) -> float:
    """Never returns: a run scoring in-process with it stays in its base's evaluation, before any checkpoint."""
    while True:
        time.sleep(3600)


def always_raises(completion: str, reference: str) -> float:
    """A broken reward function: raises on every call."""
    raise ValueError("always_raises: no score")


HELDOUT_SCRIPT = (0.25, 0.5, 0.75, 0.5, 0.25)  # by round: rounds 0-4, the best (round 2) neither first nor last


def by_round(completion: str, reference: str) -> float:
    """``HELDOUT_SCRIPT[r]`` for every completion while round r is scored (r: the records in
    ``$TRUSTBATCH_TEST_SCRIPT_RUN/metrics.jsonl``), so a run's held-out accuracy follows the script whatever this
    CPU's kernels make of the policy."""
    path = os.path.join(os.environ["TRUSTBATCH_TEST_SCRIPT_RUN"], "metrics.jsonl")
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        r = sum(1 for _ in f)
    return HELDOUT_SCRIPT[r % len(HELDOUT_SCRIPT)]


def informative_first(completion: str, reference: str) -> float:
    """1 for every second completion while ``informative_first.left`` (set by a test to the first round's completion
    count) lasts, then 0: the first round's groups are informative, every later one is not (dynamic sampling
    skips those rounds). In-process scoring only (reward.workers=0): the count lives in this process."""
    informative_first.left -= 1
    return float(informative_first.left >= 0 and informative_first.left % 2 == 0)


informative_first.left = 0


def longer_than_others(prompts, completions, reference, **columns):
    """TRL's batch form comparing one call's completions: the share of the others each is longer than. Each call's
    prompts and completions go as one JSON line to the file ``$SCORER_CALLS`` (when set), so that a test sees the
    calls made in worker processes. A completion "hang" makes the call sleep for good; "slow" for 0.5 s each."""
    if os.environ.get("SCORER_CALLS"):
        with open(os.environ["SCORER_CALLS"], "a", encoding="utf-8") as f:
            f.write(json.dumps([list(prompts), list(completions)]) + "\n")
    if "hang" in completions:
        while True:
            time.sleep(3600)
    time.sleep(0.5 * completions.count("slow"))
    n = len(completions)
    return [sum(len(o) < len(c) for o in completions) / max(1, n - 1) for c in completions]


def trl_state_and_logs(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL 1.x reward that reads ``trainer_state`` and logs through ``log_metric`` and ``log_extra``: a length
    score, the call's mean length as the metric ``mean_len``, each completion's length as the column ``length``.
    Each call's (global_step, max_steps, epoch, completions) goes as one JSON line to ``$SCORER_CALLS``."""
    with open(os.environ["SCORER_CALLS"], "a", encoding="utf-8") as f:
        f.write(json.dumps([trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch,
                            list(completions)]) + "\n")
    log_metric("mean_len", sum(len(c) for c in completions) / len(completions))
    log_extra("length", [len(c) for c in completions])
    return [len(c) % 3 / 2 for c in completions]
