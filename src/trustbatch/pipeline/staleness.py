"""The staleness bound of the asynchronous pipeline, and the ESS-driven controller that moves it. Pure functions.

Staleness of a sample = (learner's policy version when it trains on the sample) − (version that sampled it),
in optimizer steps. With ``m`` optimizer steps per round, a producer that starts batch ``b`` only once the
learner has asked for batch ``b − floor(k/m)`` never produces a sample older than ``k`` (the capacity rule,
as AReaL's: a producer waits rather than generate what would be thrown away; prime-rl's rule instead
generates freely and drops late groups). We gate by capacity because on a CPU a thrown-away batch is
the most expensive thing there is; the learner still drops (and counts) any batch older than ``k`` when
it arrives, which happens only when the controller has lowered ``k`` since the batch was started.

The controller (``rollout.max_staleness=auto``; no peer has one) is additive-increase,
multiplicative-decrease on the batch ESS the learner just measured, the quantity P3O itself trusts:

- ESS < ``ess_low``: the batch was too off-policy to be worth its throughput; halve k.
- ESS ≥ ``ess_high`` and the learner waited for rollouts more than ``wait_fraction`` of the round: the
  data is nearly on-policy and the pipeline is the bottleneck; raise k by one.
- otherwise keep k. k stays in [k_min, k_max].

Halving reacts within a round or two to a collapse of trust (P3O's KL weight 1 − ESS rises at the
same time); raising by one probes slowly, as TCP does, because a stale batch costs trust for every
step it is used.
"""

from __future__ import annotations

from dataclasses import dataclass


def rounds_ahead(max_staleness: int, steps_per_round: int) -> int:
    """How many batches a producer may run ahead of the learner so that no sample is older than ``max_staleness``.

    Raises:
        ValueError: a negative bound or a non-positive steps per round.
    """
    if max_staleness < 0 or steps_per_round < 1:
        raise ValueError(f"need max_staleness >= 0 and steps_per_round >= 1, got {max_staleness}, {steps_per_round}")
    return max_staleness // steps_per_round


def may_start(batch_index: int, requested: int, max_staleness: int, steps_per_round: int) -> bool:
    """Capacity rule: batch ``batch_index`` may start once the learner has asked for batch ``requested``.

    ``requested`` is the index of the batch the learner asks for now (all before it are trained on
    and their weights pushed).
    """
    return batch_index <= requested + rounds_ahead(max_staleness, steps_per_round)


def behaviour_round(batch_index: int, ahead: int, floor: int = 0) -> int:
    """Deterministic order (``rollout.async_order=deterministic``): the round whose weights sample batch ``batch_index``.

    Round ``r``'s weights are those the learner had when it asked for batch ``r`` (the policy after ``r``
    rounds). Batch ``b`` is sampled by round ``max(floor, b − ahead)``, ``ahead = rounds_ahead(k, m)``: the
    oldest weights the capacity rule lets it start with, so it never depends on which worker makes it or
    when. With one optimizer step per round that is policy version ``max(0, b − k)``. ``floor`` is 0, or,
    after a resume from a checkpoint without the older rounds' weights, the first resumed round.
    """
    return max(floor, batch_index - ahead)


def too_stale(learner_version: int, sample_version: int, max_staleness: int) -> bool:
    """Drop rule: a sample more than ``max_staleness`` versions behind the learner is not trained on."""
    return learner_version - sample_version > max_staleness


@dataclass
class StalenessController:
    """AIMD on the batch ESS (module docstring). ``update`` returns the bound for the next batches."""

    k: int = 1
    k_min: int = 0
    k_max: int = 8
    ess_low: float = 0.90
    ess_high: float = 0.97
    wait_fraction: float = 0.05

    def __post_init__(self):
        if not (0 <= self.k_min <= self.k <= self.k_max):
            raise ValueError(f"need 0 <= k_min <= k <= k_max, got {self.k_min}, {self.k}, {self.k_max}")
        if not (0.0 < self.ess_low <= self.ess_high <= 1.0):
            raise ValueError(f"need 0 < ess_low <= ess_high <= 1, got {self.ess_low}, {self.ess_high}")

    def update(self, ess: float | None, learner_wait_s: float, round_s: float) -> int:
        """Move k after a round with batch ESS ``ess`` (None: the objective reports none; k is kept),
        in which the learner waited ``learner_wait_s`` seconds of ``round_s`` for rollouts."""
        if ess is None:
            return self.k
        if ess < self.ess_low:
            self.k = max(self.k_min, self.k // 2)
        elif ess >= self.ess_high and round_s > 0 and learner_wait_s > self.wait_fraction * round_s:
            self.k = min(self.k_max, self.k + 1)
        return self.k
