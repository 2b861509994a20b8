"""The objective registry: each objective declares, when registered, what a caller must supply.

An ``ObjectiveSpec`` says whether the learner must pass ``proximal_logprobs=``, which ``RatioStats``
keywords must cover the whole optimizer batch (``batch_stats``), which ESS scopes the objective
supports, and how each of its user options is checked (``options``). ``validate_options`` checks a
user's options against that declaration without calling the objective.

Options fall in three groups:

- **user options** (eps_low, kl, aggregation, correction, ...): checked for type and range;
- **supplied by the trainer** with every call (``TRAINER_SUPPLIED``: num_tokens, num_sequences,
  ess, ess_proximal, ess_scope, proximal_logprobs): refused as user options, because the trainer
  computes them per optimizer step (and passing them twice is a TypeError);
- **per-token tensors** (``TENSOR_INPUTS``: old_logprobs, ref_logprobs, entropy): not config
  values. An option that needs one (``correction`` needs old_logprobs, ``ref_kl_coef`` > 0 needs
  ref_logprobs, ``entropy_coef`` > 0 needs entropy) is refused unless the caller says it supplies
  that tensor (``validate_options(..., supplied=...)``). The trainer's learner supplies ``LEARNER_SUPPLIED``:
  ref_logprobs (from a frozen reference policy) and the entropy (with gradient), not old_logprobs.

An objective may also need **full next-token distributions** for some option values
(``full_logprobs_when``, e.g. P3O's ``kl="exact"``): the learner's log-softmax ``[B, T, V]`` and the
behaviour policy's (and the proximal snapshot's, for ``needs_proximal``). ``spec(name).needs_full_logprobs(options)``
tells the learner and the recipe; ``validate_options`` refuses such options unless the caller says
it supplies ``behavior_logprobs_full`` (a learner that can rebuild the behaviour's whole distribution).
An objective that also takes ``kl_exact`` (``ObjectiveSpec.takes_kl_exact``) accepts instead the exact KL
per token ``[B, T]``, which the learner computes chunk by chunk without a [B, T, V] log-softmax of π_θ.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Callable, Iterable, Mapping

from ._common import AGGREGATIONS, ESS_SCOPES, MAX_LOG_RATIO_CLIP, CommonOptions, ObjectiveOutput
from .corrections import CORRECTIONS, SEQ_REDUCES
from .kl import KL_ESTIMATORS
from .metrics import SHARED_METRICS, Reduction, declare

Objective = Callable[..., ObjectiveOutput]
BATCH_STATS = ("ess", "ess_proximal")
TRAINER_SUPPLIED = {
    "num_tokens": "the global valid-token count of the optimizer step",
    "num_sequences": "the global non-empty sequence count of the optimizer step",
    "ess": "the batch RatioStats of π_θ/π_b",
    "ess_proximal": "the batch RatioStats of π_θ/π_prox",
    "ess_scope": "train.ess_scope; set it there",
    "proximal_logprobs": "the π_θ snapshot taken at the start of train_on",
    # only when the options need full distributions (ObjectiveSpec.needs_full_logprobs)
    "logprobs_full": "the learner's [B, T, V] log-softmax at the response positions",
    "behavior_logprobs_full": "the behaviour policy's [B, T, V] log-probs, rebuilt by the learner from its model",
    "proximal_logprobs_full": "the [B, T, V] π_θ snapshot taken at the start of train_on",
    # instead of logprobs_full & co., when the objective takes it (ObjectiveSpec.takes_kl_exact)
    "kl_exact": "the [B, T] exact KL per position, computed by the learner's chunked LM head",
}
# what a caller must be able to supply for options that need full distributions
FULL_LOGPROBS_INPUT = "behavior_logprobs_full"
# per-token tensor input -> the option that needs it to have any effect
TENSOR_INPUTS = {"old_logprobs": "correction", "ref_logprobs": "ref_kl_coef", "entropy": "entropy_coef"}
# what ``trainer.learner.Learner`` supplies with every batch: the behaviour's whole distribution (rebuilt; where a run
# cannot hand it the behaviour model, recipes.checks.check_objective refuses), the frozen reference policy's log-probs
# and π_θ's entropy with gradient
LEARNER_SUPPLIED = (FULL_LOGPROBS_INPUT, "ref_logprobs", "entropy")


@dataclass(frozen=True)
class Opt:
    """How one user option is checked. Build with ``number``, ``choice``, ``FLAG`` or ``BAND``."""

    kind: str  # "number", "choice", "flag", "band"
    low: float | None = None
    low_open: bool = False  # True: value > low; False: value ≥ low
    high: float | None = None
    choices: tuple = ()
    none_ok: bool = False

    def describe(self) -> str:
        if self.kind == "number":
            parts = []
            if self.low is not None:
                parts.append(f"{'>' if self.low_open else '≥'} {self.low:g}")
            if self.high is not None:
                parts.append(f"≤ {self.high:g}")
            rng = " and ".join(parts)
            return f"a finite number{' ' + rng if rng else ''}{' or None' if self.none_ok else ''}"
        if self.kind == "choice":
            return "one of " + ", ".join(map(repr, self.choices)) + (" or None" if self.none_ok else "")
        if self.kind == "flag":
            return "true or false"
        return "a pair [low, high] of finite numbers with 0 ≤ low ≤ high"


def number(*, ge: float | None = None, gt: float | None = None, le: float | None = None, none_ok: bool = False) -> Opt:
    return Opt("number", low=gt if gt is not None else ge, low_open=gt is not None, high=le, none_ok=none_ok)


def choice(values: Iterable, *, none_ok: bool = False) -> Opt:
    return Opt("choice", choices=tuple(values), none_ok=none_ok)


FLAG = Opt("flag")
BAND = Opt("band")
NONNEG = number(ge=0)

COMMON_OPTIONS: dict[str, Opt] = {
    "aggregation": choice(AGGREGATIONS),
    "seq_constant": number(gt=0, none_ok=True),
    "log_ratio_clip": number(gt=0, le=MAX_LOG_RATIO_CLIP),
    "ref_kl_coef": NONNEG,
    "ref_kl": choice(sorted(KL_ESTIMATORS)),
    "entropy_coef": NONNEG,
    "check_finite": FLAG,
}
# The mismatch corrections the clipped objectives take through **options (corrections.py).
CORRECTION_OPTIONS: dict[str, Opt] = {
    "correction": choice(CORRECTIONS, none_ok=True),
    "correction_cap": number(gt=0),
    "correction_band": BAND,
    "correction_seq_reduce": choice(SEQ_REDUCES, none_ok=True),
    "correction_count_rejected": FLAG,
}


@dataclass(frozen=True)
class ObjectiveSpec:
    """What an objective is and what a caller must give it.

    needs_proximal: the learner must pass ``proximal_logprobs=`` (π_θ snapshot at the start of train_on).
    batch_stats: keyword args that take a ``RatioStats`` which must cover the whole optimizer batch:
        "ess" = ratio π_θ/π_b (logprobs vs behavior_logprobs), "ess_proximal" = ratio π_θ/π_prox.
    ess_scopes: scopes the objective supports; objectives taking ``ess_scope=`` list more than "batch".
    options: user option name -> ``Opt`` (its own keyword options; the common ones are added).
    full_logprobs_when: option name -> the values that make the objective need full distributions
        (``logprobs_full``, ``behavior_logprobs_full`` and, with needs_proximal, ``proximal_logprobs_full``,
        all [B, T, V]), e.g. {"kl": ("exact",)}.
    takes_kl_exact: the function also takes ``kl_exact=``, the per-token exact KL [B, T] (with gradient)
        in place of those full inputs (read from the signature at registration).
    metrics: every metric the function reports -> how it reduces over micro-batches and ranks
        (``objectives.metrics``: SUM, TOKEN_MEAN, MAX or RatioOf; ``SHARED_METRICS`` added).
    defaults: the function's keyword defaults (read from the signature), the only place an objective's
        option defaults live.
    """

    name: str
    fn: Objective
    needs_proximal: bool = False
    batch_stats: tuple[str, ...] = ()
    ess_scopes: tuple[str, ...] = ("batch",)
    options: Mapping[str, Opt] = field(default_factory=dict, repr=False)
    defaults: Mapping[str, object] = field(default_factory=dict, repr=False)
    full_logprobs_when: Mapping[str, tuple] = field(default_factory=dict)
    takes_kl_exact: bool = False
    metrics: Mapping[str, Reduction] = field(default_factory=lambda: dict(SHARED_METRICS), repr=False)

    def full_logprobs_cause(self, options: Mapping) -> str | None:
        """The option setting (e.g. "kl='exact'") that needs full distributions, or None."""
        for key, values in self.full_logprobs_when.items():
            v = options.get(key, self.defaults.get(key))
            if v in values:
                return f"{key}={v!r}"
        return None

    def default(self, option: str):
        """The value ``option`` takes when the caller gives none: the objective's keyword default (e.g. gspo's
        ``aggregation``), else the common one (``CommonOptions``); None for an option with neither."""
        return self.defaults[option] if option in self.defaults else _common_default(option)

    def needs_full_logprobs(self, options: Mapping) -> bool:
        """Whether ``options`` make this objective take [B, T, V] full log-probs (see ``full_logprobs_when``)."""
        return self.full_logprobs_cause(options) is not None


_REGISTRY: dict[str, ObjectiveSpec] = {}


def register(name: str, fn: Objective | None = None, *, needs_proximal: bool = False,
             batch_stats: tuple[str, ...] = (), ess_scopes: tuple[str, ...] = ("batch",),
             options: Mapping[str, Opt] | None = None, full_logprobs_when: Mapping[str, Iterable] | None = None,
             metrics: Mapping[str, Reduction] | None = None):
    """Register ``fn`` as objective ``name``; usable as ``@register(name, ...)``. Returns ``fn``.

    ``options`` must declare an ``Opt`` for every keyword parameter of ``fn`` that users may set
    (keywords in ``TRAINER_SUPPLIED`` need none), plus any option ``fn`` reads from ``**options``.
    ``full_logprobs_when`` maps an option to the values that need full distributions; ``fn`` must then
    take ``logprobs_full`` and ``behavior_logprobs_full`` (and ``proximal_logprobs_full`` if needs_proximal),
    and may take ``kl_exact`` (the per-token KL in their place). ``metrics`` declares how each metric
    ``fn`` reports beyond ``SHARED_METRICS`` reduces (``objectives.metrics``).

    Raises:
        ValueError: a taken name; an unknown batch statistic or scope; a declaration that ``fn``'s
            signature cannot honour (needs_proximal without a ``proximal_logprobs`` keyword, full
            distributions without their keywords or for an undeclared option value, a
            batch statistic that is not a keyword, extra scopes without ``ess_scope``); a keyword
            parameter without an option check; an unknown metric reduction, or one that contradicts
            ``SHARED_METRICS``.
    """

    def _add(f: Objective) -> Objective:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} is already registered")
        params = {p.name: p for p in inspect.signature(f).parameters.values()
                  if p.kind == p.KEYWORD_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)}
        decl = dict(options or {})

        def bad(msg: str):
            raise ValueError(f"register({name!r}): {msg}")

        if not set(batch_stats) <= set(BATCH_STATS):
            bad(f"batch_stats {batch_stats} must be drawn from {BATCH_STATS}")
        if "batch" not in ess_scopes or not set(ess_scopes) <= set(ESS_SCOPES):
            bad(f"ess_scopes {ess_scopes} must include 'batch' and be drawn from {ESS_SCOPES}")
        if needs_proximal and "proximal_logprobs" not in params:
            bad("needs_proximal=True but the function takes no proximal_logprobs keyword")
        for k in batch_stats:
            if k not in params:
                bad(f"batch statistic {k!r} is not a keyword of the function")
        if len(ess_scopes) > 1 and "ess_scope" not in params:
            bad(f"ess_scopes {ess_scopes} need an ess_scope keyword")
        for k in params:
            if k not in decl and k not in TRAINER_SUPPLIED and k not in COMMON_OPTIONS:
                bad(f"keyword {k!r} has no option check; pass options={{{k!r}: ...}}")
        full = {k: tuple(v) for k, v in (full_logprobs_when or {}).items()}
        if full:
            want = ["logprobs_full", "behavior_logprobs_full"] + (["proximal_logprobs_full"] if needs_proximal else [])
            for k in want:
                if k not in params:
                    bad(f"full_logprobs_when needs a {k!r} keyword")
            for k, values in full.items():
                opt = decl.get(k)
                if opt is None or opt.kind != "choice" or not set(values) <= set(opt.choices):
                    bad(f"full_logprobs_when {k}={values} must name choices of a declared choice option")
        elif "kl_exact" in params:
            bad("a kl_exact keyword needs full_logprobs_when (the option values that use it)")
        reductions = declare(name, metrics)
        defaults = {k: p.default for k, p in params.items() if p.default is not p.empty}
        _REGISTRY[name] = ObjectiveSpec(name, f, needs_proximal, tuple(batch_stats), tuple(ess_scopes),
                                        {**COMMON_OPTIONS, **decl}, defaults, full, "kl_exact" in params, reductions)
        return f

    return _add(fn) if fn is not None else _add


def spec(name: str) -> ObjectiveSpec:
    """The ``ObjectiveSpec`` registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; choose one of {names()}") from None


def get(name: str) -> Objective:
    """The objective function registered as ``name``; ValueError listing the known names otherwise."""
    return spec(name).fn


def names() -> list[str]:
    """Registered objective names, sorted."""
    return sorted(_REGISTRY)


def validate_options(name: str, options: dict, *, supplied: Iterable[str] = ()) -> dict:
    """Check a user's options for objective ``name`` without calling it; return them (a new dict).

    Checks: the key is a declared option of the objective or a ``CommonOptions`` field; it is not
    supplied by the trainer or a per-token tensor; the value's type (int is accepted for a float,
    bool and strings are not numbers) and range; that an option needing a per-token tensor
    (``TENSOR_INPUTS``) has it in ``supplied``; that correction_* options come with a correction;
    that options needing full distributions (``ObjectiveSpec.full_logprobs_when``, e.g. P3O's
    kl="exact") come from a caller that supplies ``behavior_logprobs_full``.

    Args:
        name: a registered objective.
        options: the user's keyword options (e.g. a config's ``objective.options``).
        supplied: per-token tensors the caller passes with each batch ("old_logprobs",
            "ref_logprobs", "entropy", "behavior_logprobs_full"). The trainer passes ``LEARNER_SUPPLIED``
            (its learner rebuilds the behaviour's whole distribution, where the run can hand it the behaviour
            model, recipes.checks.check_objective; runs a frozen reference policy; takes π_θ's entropy from its
            LM head), not "old_logprobs".

    Raises:
        ValueError: one line naming the objective, the option, the cause and the fix.
    """
    s = spec(name)
    if not isinstance(options, Mapping):
        raise ValueError(f"objective {name!r}: options must be a mapping of option name to value, "
                         f"got {type(options).__name__}")
    supplied = set(supplied)
    out = {}
    for key, value in options.items():
        where = f"objective {name!r}: option {key!r}"
        if key in TRAINER_SUPPLIED:
            raise ValueError(f"{where} is supplied by the trainer ({TRAINER_SUPPLIED[key]}), not a user option; remove it")
        if key in TENSOR_INPUTS:
            raise ValueError(f"{where} is a [B, T] tensor passed with each batch, not a config value; remove it")
        if key not in s.options:
            near = difflib.get_close_matches(str(key), list(s.options), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"objective {name!r}: unknown option {key!r}; {hint}known options: {', '.join(sorted(s.options))}")
        out[key] = _check(name, key, s.options[key], value, s.default(key))
    for tensor, opt in TENSOR_INPUTS.items():
        v = out.get(opt)
        if opt in out and v not in (None, 0, 0.0) and tensor not in supplied:
            raise ValueError(f"objective {name!r}: option {opt!r}={v!r} needs the {tensor} tensor, which this caller "
                             f"does not supply; remove {opt} (the trainer passes no {tensor})")
    cause = s.full_logprobs_cause(out)
    if cause is not None and FULL_LOGPROBS_INPUT not in supplied:
        raise ValueError(f"objective {name!r}: {cause} needs the behaviour policy's full log-probs [B, T, V] "
                         f"({FULL_LOGPROBS_INPUT}), which this caller does not supply; use kl='k3' or a rollout "
                         f"engine that returns them (rollout.engine=transformers, top_p=1, mode=sync)")
    loose = sorted(k for k in out if k.startswith("correction_"))
    if loose and out.get("correction") is None:
        raise ValueError(f"objective {name!r}: option {loose[0]!r} has no effect without a correction; "
                         f"remove it or set correction to one of {CORRECTIONS}")
    return out


def _common_default(key: str):
    return {f.name: f.default for f in fields(CommonOptions)}.get(key)


def _check(obj: str, key: str, opt: Opt, value, default):
    """Return ``value`` (a band as a tuple) or raise a one-line ValueError."""
    fix = f"; the default is {default!r}" if default is not None else ""

    def fail(cause: str):
        raise ValueError(f"objective {obj!r}: {key} must be {opt.describe()}, got {cause}{fix}")

    if value is None:
        if opt.none_ok:
            return None
        fail("None")
    if opt.kind == "flag":
        if not isinstance(value, bool):
            fail(_describe(value))
        return value
    if opt.kind == "choice":
        if value not in opt.choices:
            fail(_describe(value))
        return value
    if opt.kind == "band":
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            fail(_describe(value))
        lo, hi = (_as_number(obj, f"{key}[{i}]", v) for i, v in enumerate(value))
        if not (0 <= lo <= hi):
            fail(f"[{lo:g}, {hi:g}]")
        return (lo, hi)
    v = _as_number(obj, key, value)
    lo_ok = opt.low is None or (v > opt.low if opt.low_open else v >= opt.low)
    if not (lo_ok and (opt.high is None or v <= opt.high)):
        fail(repr(v))
    return value


def _as_number(obj: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        hint = ""
        if isinstance(value, str):
            try:
                hint = f"; write it unquoted with a decimal point, e.g. {float(value)!r} (YAML reads 3e-1 as a string)"
            except ValueError:
                pass
        raise ValueError(f"objective {obj!r}: {key} must be a number, got {_describe(value)}{hint}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"objective {obj!r}: {key} must be a finite number, got {v!r}")
    return v


def _describe(value) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, bool):
        return f"the bool {value!r}"
    return f"{type(value).__name__} {value!r}"
