"""The training batch: what a rollout source hands the learner, tagged with the policy version of every row."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policy.forward import Packed, Recorded, Teacher, TopK, pack


@dataclass
class TrainBatch:
    """Tensors of one rollout round. Response tensors are ``[B, C]`` (completions right-aligned).

    ``policy_version`` [B] long is the version of the weights that sampled each row
    (``rollout.NOT_THE_POLICY`` for a foreign model); staleness is computed from it, never from an
    engine. ``metrics`` are the round's rollout statistics (reward, lengths, scorer failures).

    ``behaviour`` maps a policy version to the ``Teacher`` that sampled the rows of that version (the engine's
    model, ``NOT_THE_POLICY`` the foreign one's), and ``proximal`` is the proximal snapshot's: the models the
    learner rebuilds the whole distributions from, chunk by chunk, for objectives whose options need them
    (``ObjectiveSpec.needs_full_logprobs``). A version mapped to ``Recorded`` (an engine whose distribution teacher
    forcing does not rebuild: a precision other than float32) has its rows' distributions recorded at sampling
    in ``behavior_logprobs_full`` [B, C, V] float32 (right-aligned; 0 at padding and at rows of other versions);
    otherwise no ``[B, C, V]`` tensor is stored with the batch. A version mapped to ``TopK`` (an engine that returns
    its top-k log-probs: vLLM) has its rows' top k in ``behavior_top_logprobs`` [B, C, k] float32 and
    ``behavior_top_ids`` [B, C, k] long (right-aligned; 0 elsewhere).

    ``ref_logprobs`` [B, C] are the frozen reference policy's log-probs of the sampled tokens (the reference KL,
    ``objective.ref_kl_coef``), filled by the learner once per batch (``Learner.train_on``), never [B, C, V].

    ``rewards`` [B] float32 (the scorers' rewards, before any shaping) and ``prompt_index`` [B] long (each row's
    training prompt, an index into the source's prompts: the task's training examples) are what the run's sample
    completions (``log.samples``) need besides the tensors; None where the source did not give them. So are
    ``extras``, [B] dicts of the columns reward functions logged for each row (TRL's ``log_extra``), or None.
    """

    packed: Packed
    behavior_logprobs: torch.Tensor  # [B, C] float32, log π_b at sampling
    advantages: torch.Tensor  # [B] float32
    policy_version: torch.Tensor | None = None  # [B] long; None: all rows from version 0
    proximal_logprobs: torch.Tensor | None = None  # [B, C], for objectives that declare needs_proximal
    metrics: dict[str, float] = field(default_factory=dict)
    behaviour: dict[int, Teacher] = field(default_factory=dict)
    proximal: Teacher | None = None
    behavior_logprobs_full: torch.Tensor | None = None  # [B, C, V] float32, for versions mapped to Recorded
    behavior_top_logprobs: torch.Tensor | None = None  # [B, C, k] float32, for versions mapped to TopK
    behavior_top_ids: torch.Tensor | None = None  # [B, C, k] long, their token ids
    ref_logprobs: torch.Tensor | None = None  # [B, C], log π_ref of the sampled tokens (the learner fills it)
    rewards: torch.Tensor | None = None  # [B] float32, the scorers' rewards
    prompt_index: torch.Tensor | None = None  # [B] long, the row's training prompt
    extras: list[dict] | None = None  # [B], the row's log_extra columns

    def __post_init__(self):
        if self.policy_version is None:
            self.policy_version = torch.zeros(self.advantages.shape[0], dtype=torch.long)

    def __len__(self) -> int:
        return self.advantages.shape[0]

    def select(self, idx) -> "TrainBatch":
        """Rows ``idx`` (a slice, index tensor or list), for the learner's shards and micro-batches: ``metrics`` and
        ``extras`` (the run's records, read from the whole batch) are not carried over."""
        return TrainBatch(self.packed.select(idx), self.behavior_logprobs[idx], self.advantages[idx],
                          self.policy_version[idx], behaviour=self.behaviour, proximal=self.proximal,
                          **{k: None if t is None else t[idx] for k, t in self._optional().items()})

    def _optional(self) -> dict:
        """The per-row tensors a batch may lack, by keyword."""
        return dict(proximal_logprobs=self.proximal_logprobs, behavior_logprobs_full=self.behavior_logprobs_full,
                    behavior_top_logprobs=self.behavior_top_logprobs, behavior_top_ids=self.behavior_top_ids,
                    ref_logprobs=self.ref_logprobs, rewards=self.rewards,
                    prompt_index=self.prompt_index)

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on ``device`` (the learner's); ``metrics`` are kept. No copy where it is already."""
        if self.advantages.device == torch.device(device):
            return self
        return TrainBatch(self.packed.to(device), self.behavior_logprobs.to(device), self.advantages.to(device),
                          self.policy_version.to(device), metrics=self.metrics, behaviour=self.behaviour,
                          proximal=self.proximal, extras=self.extras,
                          **{k: None if t is None else t.to(device) for k, t in self._optional().items()})

    def behaviour_versions(self) -> torch.Tensor:
        """Versions of the rows sampled by the policy itself (foreign rows left out), long [≤ B]."""
        return self.policy_version[self.policy_version >= 0]


def build_batch(rollouts, advantages: torch.Tensor, pad_id: int, metrics: dict | None = None,
                behaviour: dict[int, Teacher | Recorded | TopK] | None = None, rewards: list[float] | None = None,
                prompt_index: list[int] | None = None, extras: list[dict] | None = None) -> TrainBatch:
    """Pack ``Rollout`` records into learner tensors; behaviour log-probs are right-aligned like the completions.

    advantages: [B], one per rollout. behaviour: the ``Teacher`` (or ``Recorded``, ``TopK``) of each policy version
    among the rollouts (see ``TrainBatch``), or None. The rows of a ``Recorded`` version give
    ``behavior_logprobs_full``, those of a ``TopK`` version ``behavior_top_logprobs`` and ``behavior_top_ids``.
    rewards, prompt_index, extras: one per rollout (``TrainBatch.rewards``, ``.prompt_index``, ``.extras``), or None.

    Raises:
        ValueError: an empty completion (see ``pack``); a ``behaviour`` without the version of some rollout; a row
            of a ``Recorded`` (``TopK``) version without its recorded distribution (top-k log-probs), or recorded
            vocabularies (k) that differ.
    """
    packed = pack([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    C = packed.response_mask.shape[1]
    blp = torch.zeros(len(rollouts), C, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        blp[i, C - len(r.behavior_logprobs):] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    versions = torch.tensor([r.policy_version for r in rollouts], dtype=torch.long)
    missing = sorted({r.policy_version for r in rollouts} - set(behaviour)) if behaviour else []
    if missing:
        raise ValueError(f"no behaviour model for policy version(s) {missing} of the rollouts; every engine of the "
                         "round must hand its teacher")
    kept = {kind: {v for v, t in (behaviour or {}).items() if isinstance(t, kind)} for kind in (Recorded, TopK)}
    top = {f: _right_aligned(rollouts, kept[TopK], C, f) for f in ("behavior_top_logprobs", "behavior_top_ids")}
    return TrainBatch(packed=packed, behavior_logprobs=blp, advantages=advantages.float(), policy_version=versions,
                      metrics=dict(metrics or {}), behaviour=dict(behaviour or {}),
                      behavior_logprobs_full=_right_aligned(rollouts, kept[Recorded], C, "behavior_logprobs_full"),
                      rewards=None if rewards is None else torch.tensor(rewards, dtype=torch.float32),
                      prompt_index=None if prompt_index is None else torch.tensor(prompt_index, dtype=torch.long),
                      extras=extras, **top)


def _right_aligned(rollouts, versions: set, C: int, field: str) -> torch.Tensor | None:
    """The [n_i, W] tensors ``field`` of the rollouts of ``versions`` (a recorded distribution, W = V; top-k
    log-probs or ids, W = k), right-aligned into [B, C, W] of their dtype (0 elsewhere); None without such versions.
    Raises ValueError: such a rollout without one, or widths that differ."""
    if not versions:
        return None
    rows = [i for i, r in enumerate(rollouts) if r.policy_version in versions]
    lacking = [i for i in rows if getattr(rollouts[i], field) is None]
    if lacking:
        raise ValueError(f"{len(lacking)} rollouts of a recording engine carry no {field}; build the engine with "
                         "record=True")
    widths = {getattr(rollouts[i], field).shape[-1] for i in rows}
    if len(widths) > 1:
        raise ValueError(f"the rollouts' {field} have widths {sorted(widths)} (vocabulary or k); they must share one")
    dtype = getattr(rollouts[rows[0]], field).dtype if rows else torch.float32
    out = torch.zeros(len(rollouts), C, widths.pop() if widths else 0, dtype=dtype)
    for i in rows:
        t = getattr(rollouts[i], field)
        out[i, C - t.shape[0]:] = t
    return out
