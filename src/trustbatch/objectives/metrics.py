"""How each metric an objective reports reduces over the micro-batches and ranks of one optimizer step.

An objective reports its metrics per call (one micro-batch of one rank) as plain floats; the whole
optimizer step's value is one of four reductions, which the objective declares at registration
(``register(..., metrics=...)``; ``ObjectiveSpec.metrics``):

- ``SUM``: the call's value is already its share of a global quantity (a loss normalised by the global
  token count the caller passes as ``num_tokens``) or a count: the step's value is the sum.
- ``TOKEN_MEAN``: a mean over the call's valid tokens: the step's value is the token-weighted mean,
  Σ_i n_i·v_i / Σ_i n_i over calls i with n_i valid tokens (exactly the mean over all tokens for a
  token mean; for a per-call statistic such as a quantile, its token-weighted average: the trainer's ``Learner``
  logs ``ratio_p50``/``ratio_p99`` over the whole step's tokens instead).
- ``MAX``: the largest value of any call.
- ``RatioOf(num, den)``: a ratio of sums, num / den with both parts TOKEN_MEAN metrics of the same call
  (Σ x / n and Σ y / n), so that the step's value is Σ x / Σ y over every call (0 when Σ y = 0); the
  per-call ratio is not averaged.

``MetricReducer`` applies the declarations; it imports nothing (a ``world`` is any object with ``size``,
``sum``, ``max`` and ``gather``, e.g. ``trustbatch.parallel.World``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

SUM = "sum"
TOKEN_MEAN = "token_mean"
MAX = "max"


@dataclass(frozen=True)
class RatioOf:
    """A ratio of sums: ``num`` / ``den``, two TOKEN_MEAN metrics of the same call, divided after reduction."""

    num: str
    den: str


Reduction = Union[str, RatioOf]

# ratio_metrics (every objective) and finish's loss: num_tokens is the call's count, the loss its share of the
# step's loss when the caller passes the global num_tokens/num_sequences
SHARED_METRICS: dict[str, Reduction] = {
    "loss": SUM, "num_tokens": SUM, "ratio_p50": TOKEN_MEAN, "ratio_p99": TOKEN_MEAN, "ratio_max": MAX,
    "abs_log_ratio_mean": TOKEN_MEAN, "abs_log_ratio_max": MAX, "log_ratio_clamped": TOKEN_MEAN,
    "kl_behavior": TOKEN_MEAN, "clip_fraction": TOKEN_MEAN, "ess": TOKEN_MEAN,
    # add_regularizers, when its tensor is passed
    "kl_ref": TOKEN_MEAN, "entropy": TOKEN_MEAN,
}
# corrections.correction_weights, for objectives taking CORRECTION_OPTIONS
CORRECTION_METRICS: dict[str, Reduction] = {
    "correction_capped": TOKEN_MEAN, "correction_zeroed": TOKEN_MEAN, "correction_weight_mean": TOKEN_MEAN,
}
KINDS = (SUM, TOKEN_MEAN, MAX)


def check_reductions(reductions: Mapping[str, Reduction]) -> None:
    """Refuse an unknown reduction, or a ``RatioOf`` whose parts are not declared TOKEN_MEAN metrics (ValueError)."""
    for key, how in reductions.items():
        if isinstance(how, RatioOf):
            for part in (how.num, how.den):
                if reductions.get(part) != TOKEN_MEAN:
                    raise ValueError(f"metric {key!r} = {how}: {part!r} must be a declared {TOKEN_MEAN!r} metric")
        elif how not in KINDS:
            raise ValueError(f"metric {key!r}: reduction {how!r} is not one of {KINDS} or a RatioOf")


class MetricReducer:
    """Accumulates per-micro-batch metrics (``add``) and reduces them over ranks (``result``) as declared.

    Args:
        reductions: metric name -> ``SUM``, ``TOKEN_MEAN``, ``MAX`` or ``RatioOf`` (``check_reductions``).
        owner: who declared them (an objective's name), for the error message.

    Raises (``add``):
        KeyError: a metric without a declared reduction; declare it where its objective is registered.
    """

    def __init__(self, reductions: Mapping[str, Reduction], owner: str = "objective"):
        self.reductions = reductions
        self.owner = owner
        self.sums: dict[str, float] = {}  # SUM: Σ v; TOKEN_MEAN and RatioOf: Σ n·v (a RatioOf is recomputed)
        self.maxes: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float], tokens: float) -> None:
        """One call's ``metrics``, computed over ``tokens`` valid tokens."""
        for k, v in metrics.items():
            how = self.reductions.get(k)
            if how is None:
                raise KeyError(f"{self.owner} reports metric {k!r} without a reduction; declare it "
                               f"(register(..., metrics={{{k!r}: ...}}))")
            if how == MAX:
                self.maxes[k] = max(self.maxes.get(k, float("-inf")), v)
            elif how == SUM:
                self.sums[k] = self.sums.get(k, 0.0) + v
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * tokens

    def result(self, local_tokens: float, world=None) -> dict[str, float]:
        """The step's metrics: this rank's ``add``s over ``local_tokens`` valid tokens, with every rank's of ``world``.

        Under a ``world`` of several ranks every rank must call it (a sum, a max and two gathers): a rank
        that added nothing still gets every key another rank reported. One rank (or no world) divides its own
        sums, with the same float arithmetic as the several-rank path has per rank.
        """
        if world is None or world.size == 1:
            out = {k: (v if self.reductions[k] == SUM else v / max(local_tokens, 1.0)) for k, v in self.sums.items()}
            out.update(sorted(self.maxes.items()))
        else:
            keys = sorted({k for ks in world.gather(sorted(self.sums)) for k in ks})
            mk = sorted({k for ks in world.gather(sorted(self.maxes)) for k in ks})
            total = world.sum([self.sums.get(k, 0.0) for k in keys] + [local_tokens])
            tokens = total[-1]
            # SUM metrics are per-rank shares of a global quantity: their sum over ranks is the step's value
            out = {k: (v if self.reductions[k] == SUM else v / max(tokens, 1.0)) for k, v in zip(keys, total[:-1])}
            out.update(zip(mk, world.max([self.maxes.get(k, float("-inf")) for k in mk])))
        for k, how in self.reductions.items():
            if isinstance(how, RatioOf) and k in out:
                out[k] = out[how.num] / out[how.den] if out[how.den] > 0 else 0.0
        return out


def declare(objective: str, metrics: Mapping[str, Reduction] | None) -> dict[str, Reduction]:
    """An objective's whole declaration: ``SHARED_METRICS`` with its own ``metrics``, checked.

    Raises:
        ValueError: ``register(objective)``: an unknown reduction, a RatioOf over undeclared parts, or a
            metric that contradicts ``SHARED_METRICS``.
    """
    try:
        out = merged(SHARED_METRICS, metrics or {})
        check_reductions(out)
    except ValueError as e:
        raise ValueError(f"register({objective!r}): {e}") from None
    return out


def merged(*parts: Mapping[str, Reduction]) -> dict[str, Reduction]:
    """The union of reduction declarations; a metric declared twice must reduce the same way (ValueError)."""
    out: dict[str, Reduction] = {}
    for p in parts:
        for k, how in p.items():
            if out.get(k, how) != how:
                raise ValueError(f"metric {k!r} is declared as {out[k]!r} and as {how!r}")
            out[k] = how
    return out
