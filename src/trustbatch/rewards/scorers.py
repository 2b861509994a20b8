"""Reward scorers by name, and scoring in this process: the scores, errors and clamps of a round, and its verdict.

``get`` (names: the package docstring) returns a scorer; ``score_one``/``score_local`` score in this process,
counting a scorer's errors instead of raising; ``check_scoring`` judges a round's ``ScoreResult``.
``pool.RewardPool`` runs the same scorers in worker processes with a time limit.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import inspect
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..chat import Conversation
from ..errors import UserError
from .countdown import countdown_exact_reward, countdown_reward
from .gsm8k import gsm8k_reward
from .math_answer import math_reward
from .trl_kwargs import PASSED, STATE_KEY, RewardLogs

Scorer = Callable[[str, str], float]


@dataclass
class ScoreResult:
    """What one scoring call (``score_local``, ``RewardPool.score``) gives: rewards in order and its failure counts."""

    # one per completion: in [0, 1] for a task's scorer; a reward function's (reward.functions, as TRL's
    # reward_funcs) and a reward model's (policy.reward_model) as they were returned
    rewards: list[float]
    errors: int  # scorer raised (or exited), returned a non-finite value or a non-number, or its process died
    timeouts: int  # scorer ran past the time limit
    clamped: int = 0  # a task scorer's finite rewards outside [0, 1], clamped into it (``settle``)
    last_error: str | None = None  # one line: the last failure's cause (and the tail of what the scorer printed)
    unscored: int = 0  # completions never scored (reward 0) because the call stopped early (``stopped_early``)
    # several reward functions (``functions.WeightedRewards``): each one's rewards by label, and how many
    # functions scored each completion (the failure rate is over completions x functions)
    components: dict[str, list[float]] = field(default_factory=dict)
    functions: int = 1
    # several reward functions: each one's failures (errors + timeouts) and its last error, by label, so that one
    # broken function among k is judged on its own rate, not diluted to 1/k of the scorings
    failures: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    # the completions a function said does not apply to (None, TRL's NaN): reward 0, left out of its logged mean; of
    # several functions' (``functions.WeightedRewards``), those none of them applies to: no advantage, no mean
    none: list[int] = field(default_factory=list)
    # what reward functions logged through TRL's ``log_metric(name, value)``: each call's value, by name
    logged: dict[str, list[float]] = field(default_factory=dict)
    # ... and through ``log_extra(column, values)``: by column, {completion index: value}
    extra: dict[str, dict[int, object]] = field(default_factory=dict)

    def __add__(self, other: "ScoreResult") -> "ScoreResult":
        """Both results in one, e.g. the several scoring calls of one round (dynamic sampling)."""
        components = {k: v + other.components.get(k, []) for k, v in self.components.items()}
        failures = {k: (self.failures.get(k, (0, None))[0] + other.failures.get(k, (0, None))[0],
                        other.failures.get(k, (0, None))[1] or self.failures.get(k, (0, None))[1])
                    for k in {**self.failures, **other.failures}}
        return ScoreResult(self.rewards + other.rewards, self.errors + other.errors, self.timeouts + other.timeouts,
                           self.clamped + other.clamped, other.last_error or self.last_error,
                           self.unscored + other.unscored, components, max(self.functions, other.functions), failures,
                           self.none + [len(self.rewards) + i for i in other.none],
                           merge_logged([self.logged, other.logged]),
                           merge_extra([self.extra, {c: {len(self.rewards) + i: v for i, v in col.items()}
                                                      for c, col in other.extra.items()}]))


def merge_logged(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """``ScoreResult.logged`` of several results (calls, functions) in one: each name's values, in order."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for name, values in part.items():
            out[name] = out.get(name, []) + values
    return out


def merge_extra(parts: list[dict[str, dict[int, object]]]) -> dict[str, dict[int, object]]:
    """``ScoreResult.extra`` of several results over the same completions in one (a later part's value of a column
    for a completion wins, as a later ``log_extra`` of a column does)."""
    out: dict[str, dict[int, object]] = {}
    for part in parts:
        for column, values in part.items():
            out[column] = {**out.get(column, {}), **values}
    return out


def stopped_early(failed: int, n: int, max_failure_rate: float | None) -> bool:
    """Whether a scoring call of ``n`` completions may stop after ``failed`` failures: ``check_scoring`` with
    this rate will refuse the call whatever the rest score, since failed / n > max_failure_rate already
    (the same expression, so the two never disagree by rounding). None never stops."""
    return max_failure_rate is not None and n > 0 and failed / n > max_failure_rate


def one_line(text: str, limit: int = 300) -> str:
    """``text`` with its whitespace runs (newlines included) collapsed to one space, cut to ``limit`` characters
    (the end is kept: a traceback's last line names the error)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else "…" + flat[-(limit - 1):]


BUILTIN: dict[str, Scorer] = {"math": math_reward, "gsm8k": gsm8k_reward, "countdown": countdown_reward,
                               "countdown_exact": countdown_exact_reward}
MODEL_PREFIX = "rm:"  # a reward model's term in reward.functions' sum: rm:DIR (``functions.WeightedRewards``)


def is_model(name: str) -> bool:
    """Whether ``name`` is a reward model's term (``rm:DIR``)."""
    return isinstance(name, str) and name.startswith(MODEL_PREFIX)


def import_reasoning_gym():
    """``(reasoning_gym, reasoning_gym.factory.DATASETS)``, imported without the SyntaxWarnings one of its
    dependencies (cellpylib 2.4: ``is`` with a literal) prints while Python compiles it: on the first import after an
    install that did not precompile bytecode (uv's default), they would be the first lines a user sees."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    return reasoning_gym, DATASETS


_TUPLE = "__tuple__"


def _tag_tuples(x):
    if isinstance(x, tuple):
        return {_TUPLE: [_tag_tuples(v) for v in x]}
    if isinstance(x, list):
        return [_tag_tuples(v) for v in x]
    if isinstance(x, dict):
        return {k: _tag_tuples(v) for k, v in x.items()}
    return x


def _untag(d: dict):
    return tuple(d[_TUPLE]) if d.keys() == {_TUPLE} else d


def entry_reference(entry: dict) -> str:
    """A reasoning-gym entry's ``answer`` and ``metadata`` as the JSON reference ``ReasoningGymScorer`` reads back.

    Tuples are written as ``{"__tuple__": [...]}`` so they come back as tuples: JSON has only lists, and some tasks'
    ``score_answer`` compares with ``==`` against a tuple of tuples (``arc_agi`` and ``rearc``: a list never equals
    it, so their own answer scored 0.05). Other values JSON cannot hold are written as ``str``.
    """
    return json.dumps(_tag_tuples({"answer": entry["answer"], "metadata": entry.get("metadata", {})}), default=str)


class ReasoningGymScorer:
    """Scores with the reasoning-gym task's ``score_answer(answer, entry)``; the reference is the entry as JSON
    (``entry_reference``; a plain JSON object, such as a data file's, is read as it is)."""

    def __init__(self, task: str):
        reasoning_gym, DATASETS = import_reasoning_gym()
        if task not in DATASETS:
            raise UserError(f"unknown reasoning-gym task {task!r} in reward 'rg:{task}'")
        self.task = task
        self._ds = reasoning_gym.create_dataset(task, size=1, seed=0)

    def __call__(self, completion: str, reference: str) -> float:
        entry = json.loads(reference, object_hook=_untag)
        return float(self._ds.score_answer(completion.strip(), entry))


class FinalAnswerScorer:
    """Worked steps that end in ``answer X``: the reasoning-gym task's ``score_answer`` of X alone.

    The steps are not checked (only the outcome is rewarded, as in RL with a verifier). A completion with
    no ``answer``, or with anything but a number after the last one, is malformed and scores 0.
    """

    _FINAL = re.compile(r"answer\s*:?\s*([+-]?\d[\d,]*(?:\.\d+)?)\s*\.?\s*$")

    def __init__(self, task: str):
        self.inner = ReasoningGymScorer(task)

    def __call__(self, completion: str, reference: str) -> float:
        m = self._FINAL.search(completion)
        return self.inner(m.group(1), reference) if m else 0.0


# In a completion's context: which group of its round it belongs to (set by the rollout source and held-out
# evaluation), for ``BatchForm``'s one call per group; never passed to a reward function as a column.
GROUP_KEY = "_trustbatch_group"
# ... and its token ids (EOS included, as TRL's ``completion_ids``), for a batch-form function that takes them
COMPLETION_IDS_KEY = "_trustbatch_completion_ids"

Outcome = tuple[float, str, str | None]  # one completion's (reward, status, cause), as ``score_one`` gives
Logged = tuple[list[tuple[str, float]], dict[str, list]]  # a call's log_metric (name, value)s and log_extra columns


class BatchForm:
    """A reward function in TRL's batch form, ``f(prompts, completions, **columns) -> list``, called once per group.

    A group is a run of consecutive completions with the same ``GROUP_KEY`` in their contexts (the rollout source
    numbers a round's groups: one prompt drawn twice in a row is two groups), or, without one, the same prompt
    (``groups``). ``f`` gets that group's prompts, completions, ``reference`` (gold answers) and each data column as
    lists of the group's length, so it may compare them (rank within the group). A prompt given as chat messages
    (``chat.Conversation``, TRL's conversational format) reaches ``f`` as those messages and each completion as
    ``[{"role": "assistant", "content": text}]``, as TRL's ``GRPOTrainer`` passes them; a function that takes
    ``completion_ids`` (by name, or ``**kwargs``) gets each completion's token ids too (``COMPLETION_IDS_KEY``; TRL's
    ``get_soft_overlong_punishment`` reads them), where the caller recorded them. A raise, a list of the wrong
    length, or a value that is not a finite number fails the whole group (reward 0, counted per completion);
    ``f`` may be ``async def`` (``await_reward``, as TRL awaits it). ``None`` or NaN scores 0 (TRL's "does not apply":
    status ``"none"``, left out of the function's logged mean as
    TRL's nanmean leaves it); a finite score outside [0, 1] is ``settle``d by the pool that records it.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        # of TRL's completion_ids, trainer_state, log_metric, log_extra
        self.takes = {k for k in ("completion_ids", *PASSED) if _takes(fn, k)}

    def score_group(self, completions: list[str], references: list[str],
                    contexts: list[dict] | None) -> tuple[list[Outcome], Logged | None]:
        """One call of ``f`` on one group: an outcome per completion, in order, and what the call logged (TRL's
        ``log_metric``, ``log_extra``: ``RewardLogs.result``; None on a failed call). Only KeyboardInterrupt
        propagates.

        ``contexts[i]`` is ``{"prompt": ..., **columns}`` of completion i, or None (empty prompts, no columns).
        """
        ctx = contexts or [{"prompt": ""} for _ in completions]
        # the data's columns but those TRL leaves out (prompt, completion), or that would clash with an argument; a
        # column named reference is passed as it is, as TRL passes it, over the gold answers
        cols = {k: [c.get(k) for c in ctx] for k in ctx[0]
                if k not in ("prompt", "prompts", "completion", "completions", GROUP_KEY, COMPLETION_IDS_KEY, STATE_KEY)}
        if "completion_ids" in self.takes and all(COMPLETION_IDS_KEY in c for c in ctx):
            cols["completion_ids"] = [list(c[COMPLETION_IDS_KEY]) for c in ctx]
        logs = RewardLogs(len(completions))
        cols.update(logs.kwargs(self.takes, ctx[0].get(STATE_KEY)))  # over a data column of the name, as in TRL
        prompts = [c.get("prompt", "") for c in ctx]
        chat = bool(prompts) and isinstance(prompts[0], Conversation)
        try:
            out = self.fn(prompts=[p.as_list() for p in prompts] if chat else prompts,
                          completions=[[{"role": "assistant", "content": c}] for c in completions] if chat
                          else list(completions), **{"reference": list(references), **cols})
            if inspect.iscoroutine(out):  # an async def reward, which TRL awaits
                out = await_reward(out)
            scores = _scores(out)
            if scores is None:
                raise ValueError(f"returned {type(out).__name__} {one_line(repr(out), 60)}; return a list (or a 1-D "
                                 "array or tensor) of one score per completion")
            if len(scores) != len(completions):
                raise ValueError(f"returned {len(scores)} scores for {len(completions)} completions; return one "
                                 "score per completion")
            # None or NaN: does not apply (TRL turns None into NaN and reads NaN so; an array holds no None)
            outcomes = [(0.0, "none", None) if v is None or (is_score(v) and math.isnan(float(v))) else outcome(v)
                        for v in scores]
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a reward's bug is counted, as for every scorer
            outcomes = [(0.0, "error", one_line(f"{type(e).__name__}: {e}"))]
        cause = next((c for _, status, c in outcomes if status == "error"), None)
        return ([(0.0, "error", cause)] * len(completions), None) if cause is not None else (outcomes, logs.result())


def _scores(out) -> list | None:
    """A batch-form function's return as a list, or None for no list: a list or tuple as it is, a 1-D NumPy array or
    torch tensor as its values, and each 0-d array or tensor in a list as its number (TRL reads the return with
    ``torch.tensor(...)``, which takes them all)."""
    if getattr(out, "ndim", None) == 1 and callable(getattr(out, "tolist", None)):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        return None
    return [v.item() if getattr(v, "ndim", None) == 0 and callable(getattr(v, "item", None)) else v for v in out]


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process it runs in, the loop)
_LOOP_LOCK = threading.Lock()


def await_reward(coro):
    """The result of an ``async def`` reward's coroutine, run on one long-lived event loop of this process in a
    daemon thread, as TRL runs them: a loop per call broke a reward's loop-bound state (a semaphore, an HTTP client)
    from its second call, and ``asyncio.run`` refuses to run under a caller's own loop (a notebook). A forked reward
    worker starts its own (a thread does not survive a fork)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="trustbatch-async-rewards").start()
            _LOOP = (os.getpid(), loop)
        loop = _LOOP[1]
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def groups(scorer: Scorer | BatchForm, contexts: list[dict] | None, n: int) -> list[list[int]]:
    """The units ``scorer`` scores among ``n`` completions, as index lists in order: each completion alone, or for a
    ``BatchForm`` each group (its docstring; without contexts, all ``n`` are one group)."""
    if not isinstance(scorer, BatchForm):
        return [[i] for i in range(n)]
    key = [("all",)] * n if contexts is None else [c.get(GROUP_KEY, ("prompt", c.get("prompt"))) for c in contexts]
    units: list[list[int]] = []
    for i in range(n):
        if units and key[i] == key[units[-1][-1]]:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def score_unit(scorer: Scorer | BatchForm, completions: list[str], references: list[str],
               contexts: list[dict] | None) -> tuple[list[Outcome], Logged | None]:
    """The outcomes of one unit of ``groups`` (``outcome``s, for ``record`` to ``settle``) and what it logged: a
    group's one call of a ``BatchForm``, else its single completion's (which logs nothing)."""
    if isinstance(scorer, BatchForm):
        return scorer.score_group(completions, references, contexts)
    return [_unsettled(scorer, completions[0], references[0])], None


def takes_batch(fn: Callable) -> bool:
    """Whether ``fn`` is a batch-form reward function: it has a parameter named ``completions`` or ``completion_ids``
    (TRL's names), or takes keywords alone (``f(**kwargs)``, as TRL calls every reward function) where
    ``f(completion, reference)`` would not bind."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the per-completion form
        return False
    params = sig.parameters
    if "completions" in params or "completion_ids" in params:
        return True
    try:
        sig.bind("completion", "reference")
        return False
    except TypeError:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts a keyword argument ``name``: a parameter of that name, or ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def get(name: str) -> Scorer:
    """The scorer named ``name`` (see the module docstring).

    Raises:
        UserError: unknown name, a reasoning-gym task that does not exist, or a ``module:function``
            whose module is missing or raises on import (any exception, or ``sys.exit``), or that
            is missing or not callable. The message is one line and names the module. A reward
            model's term (``rm:DIR``): it is no scorer (``functions.WeightedRewards`` loads it).
    """
    if is_model(name):
        raise UserError(f"reward {name!r} is a reward model, which is scored in the trainer's process beside the "
                        "learner, not as a scorer here (reward workers, rollout workers, reward.name, held-out "
                        "evaluation); set it as reward.model=DIR")
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith("rg:"):
        return ReasoningGymScorer(name[3:])
    if name.startswith("rg-final:"):
        return FinalAnswerScorer(name[len("rg-final:"):])
    if ":" in name:
        fn = _user_function(name)
        return BatchForm(fn) if takes_batch(fn) else fn
    if "/" in name or os.path.isdir(name):  # TRL takes a reward model's id or folder in reward_funcs
        raise UserError(f"reward {name!r} is no scorer; a reward model (TRL's reward_funcs=[MODEL]) is "
                        f"reward.model={name} here (the Python API: overrides={{'reward.model': {name!r}}}; "
                        "trustbatch eval scores with a scorer)")
    raise UserError(f"unknown reward {name!r}; use one of {sorted(BUILTIN)}, 'rg:TASK' or 'module:function'")


def _user_function(name: str) -> Scorer:
    mod, _, fn = name.partition(":")
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name is not None and (mod == e.name or mod.startswith(e.name + ".")):
            raise UserError(f"reward {name!r}: no module named {e.name!r}; check the spelling, or put its "
                            "directory on PYTHONPATH") from None
        raise UserError(f"reward {name!r}: importing module {mod!r} failed: {one_line(str(e))}; install "
                        f"{e.name!r} or fix the import") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - any error (or sys.exit) in user code at import is bad input
        raise UserError(f"reward {name!r}: importing module {mod!r} raised {type(e).__name__}: "
                        f"{one_line(str(e), 200)}; fix the module") from None
    f = getattr(module, fn, None)
    if f is None:
        raise UserError(f"reward {name!r}: module {mod!r} has no {fn!r}; name a function as module:function")
    if not callable(f):
        raise UserError(f"reward {name!r} is not callable")
    return f


def is_score(value: object) -> bool:
    """Whether a scorer's return value is a score: an int, float or bool, or a NumPy scalar of one of those.

    Anything else is refused rather than converted: ``float("0.75")`` would read a string as a score,
    ``float(tensor)`` hides a tensor of shape [1] that was meant to be per-token.
    """
    if isinstance(value, (int, float)):  # bool is an int; numpy.float64 is a float
        return True
    dtype = getattr(value, "dtype", None)  # numpy.float32, numpy.int64, numpy.bool_ ...: not int/float subclasses
    return (type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0
            and getattr(dtype, "kind", "") in ("b", "i", "u", "f"))


def score_one(scorer: Scorer, completion: str, reference: str, *, clamp: bool = True) -> Outcome:
    """Score one completion in this process: ``(reward, status, cause)``.

    ``status`` is ``"ok"``, ``"clamped"`` (a finite reward outside [0, 1], clamped into it; with ``clamp=False``
    such a reward is ``"ok"`` as it was returned, ``settle``) or ``"error"`` (the scorer raised, called
    ``sys.exit``, or returned a non-finite value or anything but an int, float, bool or NumPy scalar of those
    (``is_score``); the reward is 0). ``cause`` is a one-line description for ``"error"``, else None. Only
    KeyboardInterrupt propagates.
    """
    return settle(_unsettled(scorer, completion, reference), clamp)


def _unsettled(scorer: Scorer, completion: str, reference: str) -> Outcome:
    try:
        return outcome(scorer(completion, reference))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - sys.exit() in a scorer must not end the run silently
        return 0.0, "error", one_line(f"{type(e).__name__}: {e}")


def outcome(raw: object) -> Outcome:
    """A scorer's return value as ``(reward, status, cause)``: a finite number as it is (status ``"outside"`` when
    outside [0, 1], for ``settle`` to clamp or keep), anything else (not a number, ``is_score``; NaN or inf) an
    error scoring 0."""
    if not is_score(raw):
        return 0.0, "error", one_line(f"the scorer returned {type(raw).__name__} {raw!r}, not a number; "
                                      "return an int, float or bool", 200)
    v = float(raw)
    if not math.isfinite(v):
        return 0.0, "error", f"the scorer returned {v}"
    return v, "ok" if 0.0 <= v <= 1.0 else "outside", None


def settle(o: Outcome, clamp: bool) -> Outcome:
    """An ``outcome`` as it is recorded. A reward ``"outside"`` [0, 1]: with ``clamp`` (a task's scorer, whose
    contract is [0, 1]: issue 10 counts and warns about a scorer's bug returning 5) clamped into it, status
    ``"clamped"``; without (``functions.WeightedRewards``: a reward function, which TRL sums as returned, so a
    format penalty of −1 stays −1) kept as it was returned, status ``"ok"``."""
    v, status, _ = o
    if status != "outside":
        return o
    return (min(1.0, max(0.0, v)), "clamped", None) if clamp else (v, "ok", None)


def score_local(scorer: Scorer | BatchForm, completions: list[str], references: list[str], *,
                contexts: list[dict] | None = None, max_failure_rate: float | None = None,
                clamp: bool = True) -> ScoreResult:
    """Score each completion (a ``BatchForm`` each group, ``groups``) in this process, counting errors and clamped
    rewards (no time limit). ``contexts``: as in ``RewardPool.score``; ``clamp``: as in ``settle``.

    With ``max_failure_rate``, scoring stops once the errors exceed that fraction of all ``completions``
    (``stopped_early``); the rest get reward 0 and are counted in ``unscored``.
    """
    res = ScoreResult([0.0] * len(completions), 0, 0)
    units = groups(scorer, contexts, len(completions))
    for k, unit in enumerate(units):
        if stopped_early(res.errors, len(completions), max_failure_rate):
            res.unscored = sum(len(u) for u in units[k:])
            break
        outcomes, logged = score_unit(scorer, [completions[i] for i in unit], [references[i] for i in unit],
                                      None if contexts is None else [contexts[i] for i in unit])
        record(res, unit, outcomes, clamp, logged)
    return res


def record(res: ScoreResult, unit: list[int], outcomes: list[Outcome], clamp: bool = True,
           logged: Logged | None = None) -> None:
    """Put one unit's outcomes into ``res``: rewards at the unit's indices (``settle``d with ``clamp``), its
    errors, clamps and last error, and what its call logged (``score_unit``)."""
    for i, (v, status, cause) in zip(unit, (settle(o, clamp) for o in outcomes)):
        res.rewards[i] = v
        res.errors += status == "error"
        res.clamped += status == "clamped"
        if status == "none":
            res.none.append(i)
        res.last_error = cause or res.last_error
    if logged is not None:
        metrics, extra = logged
        for name, v in metrics:
            res.logged.setdefault(name, []).append(v)
        for column, values in extra.items():
            res.extra.setdefault(column, {}).update(zip(unit, values))


def check_scoring(result: ScoreResult, *, scorer: str, max_failure_rate: float, where: str,
                  n: int | None = None) -> str | None:
    """Judge one round of scoring: None if clean, a one-line warning if anything failed or was clamped.

    Args:
        result: the round's scores (add up several ``ScoreResult`` with ``+``).
        scorer: the reward name, for the message.
        max_failure_rate: ``reward.max_failure_rate``, a fraction in [0, 1].
        where: what was scored, e.g. ``"round 12"``, for the message.
        n: completions scored (default ``len(result.rewards)``); with several reward functions the rate is over
            n x ``result.functions`` scorings, and each function's own (``result.failures``) over n.

    Raises:
        UserError: (errors + timeouts) / n is above ``max_failure_rate``, or one reward function's failures / n
            is (the message then names that function); the message names the counts, the scorer, its last error
            and the config keys to change.
    """
    completions = len(result.rewards) if n is None else n
    for label, (failed, cause) in result.failures.items():
        if completions > 0 and failed / completions > max_failure_rate:
            last = f"; last error: {cause}" if cause else ""
            stopped = "; scoring stopped once it was above the limit" if result.unscored else ""
            raise UserError(f"{where}: reward function {label!r} of {scorer!r} failed on {failed / completions:.0%} "
                            f"of completions ({failed} of {completions}{stopped}), above reward.max_failure_rate="
                            f"{max_failure_rate:g}{last}; fix it or remove it from reward.functions, or raise "
                            "reward.timeout_s or reward.max_failure_rate")
    n = completions * result.functions
    failed = result.errors + result.timeouts
    if n <= 0 or failed + result.clamped == 0:
        return None
    last = f"; last error: {result.last_error}" if result.last_error else ""
    what = "completions" if result.functions == 1 else f"scorings ({result.functions} reward functions)"
    counts = f"{result.errors} errors and {result.timeouts} timeouts in {n} {what}"
    if result.unscored:  # the call stopped once this verdict was certain
        counts += f", {result.unscored} of them left unscored"
    if failed / n > max_failure_rate:
        raise UserError(f"{where}: reward {scorer!r} failed on {failed / n:.0%} of completions ({counts}), above "
                        f"reward.max_failure_rate={max_failure_rate:g}{last}; fix the scorer, or raise "
                        "reward.timeout_s or reward.max_failure_rate")
    clamped = f", {result.clamped} rewards clamped into [0, 1]" if result.clamped else ""
    return f"{where}: reward {scorer!r}: {counts} (scored 0){clamped}{last}"


def score_all(scorer: Scorer, completions: list[str], references: list[str]) -> tuple[list[float], int]:
    """``score_local``'s rewards and error count, as ``(rewards, errors)``; kept for existing callers."""
    res = score_local(scorer, completions, references)
    return res.rewards, res.errors
