"""Rollout sources: where a round's training batch comes from. The loop only calls ``next_batch``.

``SyncSource`` samples on demand, in the trainer's process, from the engine the weight sync keeps
up to date: G completions per prompt, scored, filtered (DAPO dynamic sampling), shaped (DAPO
overlong penalty), turned into per-group advantages, packed and tagged with the policy version of
every row. An asynchronous source or a Ray rollout pool is another implementation of the same
protocol; the loop cannot tell them apart.
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..advantages import group_advantages, overlong_penalty
from ..data.tasks import LongPrompts
from ..parallel import World
from ..rewards import COMPLETION_IDS_KEY, GROUP_KEY, STATE_KEY, ScoreResult, round_state
from ..rollout.engine import SamplingParams
from ..seeding import row_seed
from .batch import TrainBatch, build_batch


class RolloutSource(Protocol):
    last_metrics: dict[str, float]  # the round's rollout metrics, also when next_batch returns None

    def next_batch(self, learner_version: int) -> TrainBatch | None:
        """The next round's batch, tagged with policy versions; None when every group was uninformative."""
        ...

    def on_update(self, learner_metrics: dict[str, float]) -> None:
        """Told after each round's optimizer steps (an async source may move its staleness bound)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


def sample_groups(engine, foreign, prompts: list[list[int]], group_size: int, foreign_fraction: float,
                  sampling: SamplingParams, seeds: list[int] | None = None) -> list:
    """G rollouts per prompt, grouped; with a foreign engine, the last round(G·f) of each group are its samples.

    ``seeds``: one per prompt (the group's random streams; the foreign part uses derived seeds).
    """
    G = group_size
    m = round(G * foreign_fraction) if foreign is not None else 0
    own = engine.generate(prompts, G - m, sampling, seeds=seeds)
    if m == 0:
        return own
    alien = foreign.generate(prompts, m, sampling, seeds=None if seeds is None else [row_seed(s, -1) for s in seeds])
    out = []
    for i in range(len(prompts)):
        out += own[i * (G - m):(i + 1) * (G - m)] + alien[i * m:(i + 1) * m]
    return out


@dataclass(frozen=True)
class SourceSpec:
    """How a round's batch is made from the engine's samples, as plain values (picklable: every rollout worker
    makes its batches from the same spec). The one place a sampling or batching option is declared.

    sampling: temperature, top-p, max_new_tokens of the rollouts. group_size: G completions per prompt;
    prompts_per_step: groups per batch. seed: with the batch index, fixes each batch's prompts and every group's
    random streams. prompt_order: ``epochs`` (every prompt once per epoch, in a seeded shuffle of each epoch, as a
    shuffled ``DataLoader`` gives them) or ``random`` (each drawn at random, with replacement; before this option). dynamic_sampling, max_sampling_rounds: DAPO's filter of all-equal-reward groups, with refills.
    overlong_cache: DAPO overlong shaping zone (tokens), or None. advantage, std: ``advantages.group_advantages``
    estimator and std convention. behaviour_models: hand the learner each engine's ``teacher`` with the batch
    (``TrainBatch.behaviour``), for objectives that need the whole behaviour distribution.
    """

    sampling: SamplingParams
    group_size: int
    prompts_per_step: int
    seed: int
    prompt_order: str = "epochs"
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    overlong_cache: int | None = None
    advantage: str = "zscore"
    std: str = "population"
    behaviour_models: bool = False
    max_steps: int = 0  # the run's optimizer steps, for a reward function's ``trainer_state`` (``rewards.TrainerState``)


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The order of ``n`` prompts in ``epoch`` (0-based): a Fisher–Yates shuffle (``random.shuffle``) seeded by
    (seed, epoch), so any process computes it alone (async workers, ranks, a resume)."""
    order = list(range(n))
    random.Random(row_seed(seed, -2, epoch)).shuffle(order)
    return tuple(order)


class SyncSource:
    """Sample, score, filter, shape and compute advantages for one round, on demand.

    Args:
        engine: the behaviour policy (an ``Engine``). foreign: an engine on another model, or None.
        prompts: token ids of the training prompts; references: their gold answers (same order).
        pool: a ``RewardPool`` or ``WeightedRewards`` (``score(texts, references[, contexts=])``); decode: ids -> text.
        spec: the sampling, group, filter, shaping and advantage settings (``SourceSpec``); its seed, with the
            batch index, makes batch b the same whichever process makes it and whenever (``make_batch(b)``).
        contexts: per prompt, its text and data row (``Example.context``) for batch-form reward functions, or None.
        owns_pool: ``close`` closes ``pool`` (a pool made for this source alone, e.g. ``reward.functions``).
        world: data-parallel world; each rank samples its share of the round's prompts and every rank
            receives the whole scored round, so every rank makes the same batch decisions.
        check_round: called as ``check_round(result, n)`` after each scoring call (scorer-failure limits).
        long_prompts: what ``data.max_prompt_tokens`` did to ``prompts`` (``LongPrompts``): each round logs its
            ``prompts_truncated`` and ``prompts_skipped``; None (no limit): neither.
    """

    def __init__(self, engine, prompts: list[list[int]], references: list, pool, decode: Callable[[list[int]], str],
                 spec: SourceSpec, *, pad_id: int, foreign=None, foreign_fraction: float = 0.0,
                 world: World | None = None, check_round: Callable | None = None, contexts: list[dict] | None = None,
                 owns_pool: bool = False, long_prompts: LongPrompts | None = None):
        if not prompts:
            raise ValueError("the task produced no training prompts; raise task.train_size")
        self.engine, self.foreign = engine, foreign
        self.prompts, self.references, self.pool, self.decode = prompts, references, pool, decode
        self.spec = spec
        self.sampling = spec.sampling
        self.G, self.P = spec.group_size, spec.prompts_per_step
        self.pad_id = pad_id
        self.dynamic_sampling, self.max_sampling_rounds = spec.dynamic_sampling, spec.max_sampling_rounds
        self.overlong_cache = spec.overlong_cache
        self.advantage, self.std = spec.advantage, spec.std
        self.foreign_fraction = foreign_fraction
        self.world = world or World()
        self.check_round = check_round
        self.contexts, self.owns_pool, self.long_prompts = contexts, owns_pool, long_prompts
        self.seed = spec.seed
        self.batch_index = 0  # batches made so far; batch b's randomness is a function of (seed, b)
        self.last_metrics: dict[str, float] = {}

    # ---- state (exact resume) ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        self.batch_index = int(state["batch_index"])

    def on_update(self, learner_metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        if self.owns_pool:
            self.pool.close()

    # ---- one round -----------------------------------------------------------------------------
    def _sample_and_score(self, idx: list[int], seeds: list[int], state: dict) -> tuple[list, ScoreResult]:
        """Rollouts for prompts ``idx`` (G each, grouped) and their scoring; every rank gets all of them. ``state``:
        where training stands, for a reward function's ``trainer_state`` (``rewards.TrainerState``)."""
        mine = self.world.shard(len(idx)) if self.world.size > 1 else slice(0, len(idx))
        part = idx[mine]
        ro = sample_groups(self.engine, self.foreign, [self.prompts[i] for i in part], self.G,
                           self.foreign_fraction, self.sampling, seeds[mine])
        ctx = {} if self.contexts is None else {
            "contexts": [{**self.contexts[part[x.prompt_index]], GROUP_KEY: x.prompt_index,
                          COMPLETION_IDS_KEY: x.completion_ids, STATE_KEY: state} for x in ro]}
        scored = self.pool.score([self.decode(x.completion_ids) for x in ro],
                                 [self.references[part[x.prompt_index]] for x in ro], **ctx)
        if self.world.size == 1:
            if self.check_round is not None:
                self.check_round(scored, len(ro))
            return ro, scored
        rollouts, whole = [], None
        for start, (r, s) in zip((self.world.shard_of(len(idx), k).start for k in range(self.world.size)),
                                 self.world.gather((ro, scored))):
            for x in r:
                x.prompt_index += start
            rollouts += r
            whole = s if whole is None else whole + s
        # judged on the whole round, as in one process, and alike on every rank (one rank's share over the limit
        # stopped that rank alone, the others waiting in the next collective)
        if self.check_round is not None:
            self.check_round(whole, len(rollouts))
        return rollouts, whole

    def next_batch(self, learner_version: int) -> TrainBatch | None:
        batch = self.make_batch(self.batch_index)
        self.batch_index += 1
        return batch

    def _prompt_indices(self, b: int, refill: int, need: int) -> list[int]:
        """Batch ``b``'s prompts: positions ``b·P … b·P + P - 1`` of the run's stream of epochs (``epochs``), each
        epoch a seeded shuffle of every prompt; or ``P`` draws with replacement (``random``). A dynamic-sampling
        refill draws at random in both orders: what it needs depends on the rewards, and taking it from the stream
        would move every later batch's prompts."""
        n = len(self.prompts)
        if self.spec.prompt_order == "random" or refill:
            rng = random.Random(row_seed(self.seed, b, refill))
            return [rng.randrange(n) for _ in range(need)]
        first = b * self.P
        return [epoch_order(self.seed, k // n, n)[k % n] for k in range(first, first + need)]

    def make_batch(self, b: int) -> TrainBatch | None:
        """Batch number ``b``: its prompts and random streams depend only on (seed, b), not on history.

        Returns None (and sets ``last_metrics``) when dynamic sampling kept no group.
        """
        t0 = time.time()
        G = self.G
        rollouts, rew, kept_scored, where, extras, drawn, dropped = [], [], [], [], [], [], 0  # of the kept groups
        whole, sampled = None, []  # every sampled completion's scoring and rollout, dynamic sampling's dropped too
        state = round_state(self.engine.version, self.spec.max_steps, b, self.P, len(self.prompts))
        for refill in range(self.max_sampling_rounds if self.dynamic_sampling else 1):
            need = self.P - len(rollouts) // G
            idx = self._prompt_indices(b, refill, need)
            drawn += idx
            seeds = [row_seed(self.seed, b, refill, pos) for pos in range(need)]
            new, s = self._sample_and_score(idx, seeds, state)
            whole, sampled = (s if whole is None else whole + s), sampled + new
            r, nowhere = s.rewards, set(s.none)
            applies = [i not in nowhere for i in range(len(r))]  # whether any reward function applies (TRL's non-NaN)
            for j in range(need):  # one group per prompt, G consecutive rollouts
                g = slice(j * G, (j + 1) * G)
                # all-equal rewards of the completions a function applies to: zero advantage, no signal (DAPO)
                if self.dynamic_sampling and len({v for v, ok in zip(r[g], applies[g]) if ok}) < 2:
                    dropped += 1
                    continue
                rollouts += new[g]
                rew += r[g]
                kept_scored += applies[g]
                where += [idx[x.prompt_index] for x in new[g]]
                extras += [{c: v[i] for c, v in s.extra.items() if i in v} for i in range(g.start, g.stop)]
            if len(rollouts) // G >= self.P:
                break
        nowhere = set(whole.none)
        judged = [v for i, v in enumerate(whole.rewards) if i not in nowhere] or whole.rewards
        self.last_metrics = self._sampled_metrics(judged, whole, sampled, drawn, dropped)
        if not rollouts:
            return None
        rew_t, valid = torch.tensor(rew), torch.tensor(kept_scored)
        if self.overlong_cache:
            lengths = torch.tensor([len(x.completion_ids) for x in rollouts])
            penalty = overlong_penalty(lengths, self.sampling.max_new_tokens, self.overlong_cache)
            # the penalty scores a completion no function applies to, as TRL's overlong reward function does
            rew_t, valid = rew_t + penalty, valid | (penalty != 0)
        groups = torch.arange(len(rollouts)) // G  # group = position of the group in this batch
        adv = group_advantages(rew_t, groups, self.advantage, std=self.std, valid=valid)
        self.last_metrics.update(
            reward_std=float(torch.tensor(judged).std()),
            reward_errors=float(whole.errors),
            reward_timeouts=float(whole.timeouts),
            foreign_fraction=float(round(G * self.foreign_fraction) / G),
            rollout_s=time.time() - t0,
        )
        return build_batch(rollouts, adv, self.pad_id, self.last_metrics, self._teachers(), rewards=rew,
                           prompt_index=where, extras=extras if any(extras) else None)

    def _sampled_metrics(self, judged: list[float], scored: ScoreResult, sampled: list, drawn: list[int],
                         dropped: int) -> dict[str, float]:
        """A round's metrics of every completion it sampled (``sampled``'s rollouts, ``scored`` their scoring:
        dynamic sampling's dropped groups too): ``judged``, the rewards of those some function applies to (TRL's
        nanmean: a function's None is NaN there), each function's mean (NaN where it does not apply; a round where it
        applied to nothing logs none) and what reward functions logged (``reward_metrics/NAME``: each name's mean
        over its calls), the completions' lengths and share cut at max_new_tokens (the dropped groups, often all cut
        and all 0, would hide the truncation warning), the prompts ``drawn``."""
        out = {"reward_mean": sum(judged) / len(judged), "groups_dropped": float(dropped)}
        applied = {label: [x for x in v if not math.isnan(x)] for label, v in scored.components.items()}
        out.update({f"rewards/{label}": sum(v) / len(v) for label, v in applied.items() if v})
        out.update({f"reward_metrics/{name}": sum(v) / len(v) for name, v in scored.logged.items()})
        lengths = [len(x.completion_ids) for x in sampled]
        out.update(response_length=sum(lengths) / len(lengths),
                   truncated_fraction=sum(x.truncated for x in sampled) / len(lengths))
        if self.long_prompts is not None:
            out.update(self.long_prompts.metrics(drawn))
        return out

    def _teachers(self) -> dict | None:
        """The engines' ``teacher`` by the policy version their rows carry, when the spec asks for them."""
        if not self.spec.behaviour_models:
            return None
        out = {self.engine.version: self.engine.teacher(self.sampling)}
        if self.foreign is not None and self.foreign_fraction > 0:
            out[self.foreign.version] = self.foreign.teacher(self.sampling)
        return out
