"""The learner's forward passes besides its training micro-step (``trainer.learner.Learner`` inherits them).

Without gradient: the policy's log-probs (``logprobs``), the reference policy's (``reference_logprobs``, with the
frozen reference ``_take_reference`` sets up), the proximal snapshot, the batch statistics an
objective declares (``ObjectiveSpec.batch_stats``: Σρ, Σρ², n in float64 over every micro-batch, summed over
ranks); with gradient, the empty micro-batch a rank runs so that every rank reaches the same collectives; and
the reference the learner's LM head takes the exact KL against, rebuilt per micro-batch by teacher forcing the
behaviour (and proximal) models. Under FSDP2 every no-grad pass runs as many forwards on every rank (each forward
all-gathers weights).

They read the learner's settings: ``model``, ``wrapped``, ``world``, ``sharded``, ``device``, ``precision``,
``forward_fn``, ``micro_batch_size``, ``logprob_chunk_size``, ``epochs``, ``minibatches``, ``spec``, ``full``,
``kl_in_head``, ``version``, ``options``, ``reference``, ``_pad``, ``_snapshot`` and ``teacher_forced`` (padded, or
packed as ``forward_fn``).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..objectives import DEFAULT_LOG_RATIO_CLIP, RatioStats
from ..objectives.p3o import anchor_log_weights
from ..pipeline.batch import TrainBatch
from ..policy.budget import vocab_size
from ..policy.chunked_logprobs import KLReference, RecordedInput, TeacherForced, TopKInput, logits_dtype
from ..policy.forward import Recorded, Teacher, TopK, response_logprobs
from ..policy.lora import has_lora

# batch-statistic keyword -> which log-probs the ratio's denominator comes from
_STAT_ANCHOR = {"ess": "behavior_logprobs", "ess_proximal": "proximal_logprobs"}


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode within the block, then back to its mode: the learner's no-grad passes (the proximal
    snapshot, the batch ESS, the logged ratios) are the policy's, as the engine samples it, never a dropout sample
    (which would also draw from the global random stream: a resume or another ``eval.every`` trained differently)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class ForwardPasses:
    """The forward passes of ``Learner`` other than its training micro-step (module docstring)."""

    def autocast(self):
        """The context every learner forward runs in: bf16 autocast under ``bf16-mixed``, else nothing."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _chunks(self, n: int) -> list[slice]:
        return [slice(s, min(n, s + self.micro_batch_size)) for s in range(0, n, self.micro_batch_size)]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, C]`` of the batch's completions under the current policy (no gradient), on the
        learner's device. Under FSDP2 every rank must call it (each runs as many forwards as the rank with the
        most rows)."""
        return self._no_grad_logprobs(self.model, batch)

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π_ref ``[B, C]`` of the batch's completions under the frozen reference (``Learner``'s ``reference``),
        through the learner's forward and chunked LM head without gradient, on the learner's device, in eval mode:
        the frozen copy, or the LoRA policy with its adapters disabled (peft's ``disable_adapter()``). Under FSDP2
        every rank must call it (the reference is sharded as the policy)."""
        if not _is_peft(self.reference):
            return self._no_grad_logprobs(self.reference, batch)
        with self.reference.disable_adapter():
            return self._no_grad_logprobs(self.model, batch)

    def _no_grad_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        packed = batch.packed.to(self.device)
        with self.autocast(), eval_mode(model):
            parts = [self.forward_fn(model, packed.select(c))[0] for c in self._no_grad_chunks(batch, model)]
        if not parts:  # this rank's share of the batch is empty (DAPO's dynamic sampling shrinks a round)
            return torch.zeros(0, packed.response_mask.shape[1], device=self.device)
        return torch.cat(parts)

    def _take_reference(self, reference: torch.nn.Module | None, strategy: str, param_dtype) -> torch.nn.Module | None:
        """The reference ``reference_logprobs`` runs (``Learner``'s ``reference``, whose docstring says what it may
        be), or None when the options set no reference KL (``ref_kl_coef``): a peft model wrapping the policy as it
        is; a module (or a copy of the policy) frozen, in eval mode, on the learner's device, and under FSDP2 sharded
        as the policy will be. Call before the policy is wrapped.

        Raises:
            ValueError: a LoRA policy without its peft model, a peft model of another module, a reference of
                another output vocabulary size than the policy's.
        """
        if not self.options.get("ref_kl_coef"):
            return None
        if _is_peft(reference):
            if reference.get_base_model() is not self.model:
                raise ValueError("reference is a peft model of another module; pass the policy's own (policy.adapter)")
            return reference
        if reference is None:
            if has_lora(self.model):  # a copy would duplicate the base the adapters already sit on
                raise ValueError("a LoRA policy's reference is its base with the adapters disabled: pass "
                                 "reference=policy.adapter (the peft model), not None")
            reference = copy.deepcopy(self.model)
        elif vocab_size(reference) != vocab_size(self.model):
            raise ValueError(f"the reference model has {vocab_size(reference)} output logits, the policy "
                             f"{vocab_size(self.model)}; the reference KL compares log-probs of the same tokens")
        reference = reference.requires_grad_(False).eval().to(self.device)
        if strategy == "fsdp2" and self.world.size > 1:  # its no-grad forwards all-gather as the policy's do
            self.world.wrap(reference, "fsdp2", param_dtype=param_dtype)
        return reference

    def _no_grad_chunks(self, batch: TrainBatch, model: torch.nn.Module | None = None):
        """The micro-batches of a no-grad pass over ``batch``; under FSDP2 the generator then runs empty
        forwards of ``model`` (default: the policy) until this rank has run as many as the busiest rank (counted
        before any forward)."""
        chunks = self._chunks(len(batch))
        extra = int(self.world.max([float(len(chunks))])[0]) - len(chunks) if self.sharded else 0
        yield from chunks
        if extra:
            pad = self._pad if self._pad is not None else empty_like(batch).to(self.device)
            for _ in range(extra):
                with self.autocast():
                    response_logprobs(self.model if model is None else model, pad.packed,
                                      chunk_size=self.logprob_chunk_size)

    @torch.no_grad()
    def batch_stats(self, batch: TrainBatch, names: tuple[str, ...]) -> dict[str, RatioStats]:
        """The declared ``RatioStats`` over the whole (local) batch at the current θ, summed over ranks."""
        stats = {k: RatioStats.zeros() for k in names}
        batch = batch.to(self.device)
        for c in self._no_grad_chunks(batch):
            mb = batch.select(c)
            with self.autocast(), eval_mode(self.model):
                logp, _ = self.forward_fn(self.model, mb.packed)
            for k in names:
                stats[k] = stats[k] + self._ratio_stats(logp, getattr(mb, _STAT_ANCHOR[k]), mb.packed.response_mask)
        return self._sum_stats(stats)

    def _ratio_stats(self, logp: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor) -> RatioStats:
        """``RatioStats`` of ``logp`` against ``anchor`` (both [B, C]) at the objective's own ``log_ratio_clip``, so
        that an ESS summed over micro-batches or ranks equals the one the objective computes from a whole batch."""
        return RatioStats.from_logprobs(logp, anchor, mask,
                                        log_ratio_clip=self.options.get("log_ratio_clip", DEFAULT_LOG_RATIO_CLIP))

    @torch.no_grad()
    def _local_stats(self, logp: torch.Tensor, mb: TrainBatch) -> dict[str, RatioStats]:
        """The declared ``RatioStats`` of one micro-batch from its log-probs ``logp`` [B, C] (this rank only)."""
        m = mb.packed.response_mask
        return {k: self._ratio_stats(logp, getattr(mb, _STAT_ANCHOR[k]), m) for k in self.spec.batch_stats}

    def _take_proximal(self, local: TrainBatch) -> None:
        """Store π_θ's snapshot in ``local`` (``proximal_logprobs`` [B, C]; with full distributions also
        ``proximal``, the model the learner rebuilds it from), before the batch's first update."""
        local.proximal_logprobs = self.logprobs(local)
        if self.full:
            local.proximal = Teacher(self._frozen_policy(), self.temperature,
                                     torch.bfloat16 if self.precision == "bf16-mixed" else None,
                                     name="the proximal snapshot")

    def _frozen_policy(self) -> torch.nn.Module:
        """The policy as it is now, for the rest of this ``train_on``: the module itself when it takes one optimizer
        step (every micro-step runs before the update), else a copy made once (``self._snapshot``).

        Raises:
            ValueError: a copy of an FSDP2-sharded module is needed (not supported).
        """
        if self.epochs * self.minibatches == 1:
            return self.model
        if self._snapshot is None:
            if self.sharded:
                raise ValueError("kl='exact' over several optimizer steps per batch needs a copy of the policy, "
                                 "which an FSDP2-sharded learner cannot take; set train.strategy=ddp or one step")
            self._snapshot = copy.deepcopy(self.model).requires_grad_(False)
        return self._snapshot

    def _own_teachers(self, local: TrainBatch) -> None:
        """Replace, in ``local.behaviour``, a teacher that is the learner's own module (an engine sharing it) by
        the policy frozen at this ``train_on``'s start (``_frozen_policy``): the behaviour of its rows.

        Raises:
            ValueError: rows of another version than the learner's claim the learner's own module.
        """
        for v, t in list(local.behaviour.items()):
            if isinstance(t, Teacher) and t.model is self.model:
                if bool((local.policy_version == v).any()) and v != self.version:
                    raise ValueError(f"rows of policy version {v} name the learner's own module (version "
                                     f"{self.version}) as their behaviour model; it cannot be rebuilt")
                local.behaviour = {**local.behaviour, v: Teacher(self._frozen_policy(), t.temperature, t.autocast,
                                                                 t.name)}

    def _sum_stats(self, stats: dict[str, RatioStats]) -> dict[str, RatioStats]:
        if self.world.size == 1:
            return stats
        flat = self.world.sum([float(x) for s in stats.values() for x in s.to_tensor()])
        out = {}
        for i, k in enumerate(stats):
            s1, s2, n = (torch.tensor(v, dtype=torch.float64) for v in flat[3 * i:3 * i + 3])
            out[k] = RatioStats(s1, s2, n)
        return out

    def _empty_micro_step(self, batch: TrainBatch, plan, skip_sync) -> None:
        """A micro-batch without tokens, for a rank with fewer micro-batches (or after a failure): every rank
        reaches the same collectives, and a zero loss through the forward gives every weight a zero gradient."""
        with skip_sync:
            pad = self._pad if self._pad is not None else empty_like(batch)
            with self.autocast():
                pad_logp = response_logprobs(self.wrapped, pad.packed, chunk_size=self.logprob_chunk_size)[0]
            if plan.per_micro_batch_stats:  # the other ranks sum this micro-batch's statistics, after its forward
                self._sum_stats({k: RatioStats.zeros() for k in self.spec.batch_stats})
            (pad_logp.sum() * 0.0).backward()

    def _kl_reference(self, mb: TrainBatch, kw: dict) -> KLReference:
        """What the exact KL is taken against: π_b, or for the two-anchor variant π_mix with the batch ESS's
        weights; each rebuilt from its models' hidden states (``teacher_forced``), never stored as [B, C, V],
        except π_b at the rows of a version mapped to ``Recorded``: read from ``mb.behavior_logprobs_full``
        (the distribution those rows were sampled from, which teacher forcing would not rebuild), and at the rows of
        a version mapped to ``TopK``: their top-k log-probs (``mb.behavior_top_logprobs``), against which the KL is
        the top-k lower bound (``chunked_logprobs.TopKInput``).

        Raises:
            ValueError: rows whose policy version has no behaviour model; a ``Recorded`` (``TopK``) version in a batch
                without ``behavior_logprobs_full`` (``behavior_top_logprobs``); no proximal model for two anchors, or
                a ``TopK`` version with two anchors (``KLReference``).
        """
        m = mb.packed.response_mask
        versions = mb.policy_version.unique().tolist()
        missing = [v for v in versions if v not in mb.behaviour]
        if missing:
            raise ValueError(f"objective {self.spec.name!r} with {self.spec.full_logprobs_cause(self.options)} needs "
                             f"the behaviour model of every row, but policy version(s) {missing} have none; build the "
                             "batch with behaviour= (the engines' teacher)")
        groups = [(None if len(versions) == 1 else (mb.policy_version == v).nonzero()[:, 0], mb.behaviour[v])
                  for v in versions]
        given = {Recorded: ("behavior_logprobs_full",), TopK: ("behavior_top_logprobs", "behavior_top_ids")}
        for kind, fields in given.items():
            kept = [t for _, t in groups if isinstance(t, kind)]
            if kept and getattr(mb, fields[0]) is None:
                raise ValueError(f"{kept[0].name} recorded its distribution, but the batch carries none ({fields[0]}); "
                                 "build it with build_batch from the engine's rollouts")
        forced = [(rows, t) for rows, t in groups if isinstance(t, Teacher)]
        parts = () if not forced else self.teacher_forced(mb.packed, forced).parts
        for rows, t in groups:
            if not isinstance(t, Teacher):
                tensors = [getattr(mb, f) if rows is None else getattr(mb, f)[rows] for f in given[type(t)]]
                parts += ((RecordedInput if isinstance(t, Recorded) else TopKInput)(*tensors, rows=rows),)
        behaviour = TeacherForced(parts, len(mb))
        if not self.spec.needs_proximal:
            return KLReference((behaviour,), m)
        if mb.proximal is None:
            raise ValueError(f"objective {self.spec.name!r} needs the proximal model; use train_on, which takes it")
        proximal = self.teacher_forced(mb.packed, [(None, mb.proximal)])
        if not self.kl_in_head:  # the objective mixes the two itself
            return KLReference((behaviour, proximal), m, (0.0, 0.0))
        e_b, e_p = (torch.tensor(kw[k].ess()[0], dtype=torch.float64) for k in ("ess", "ess_proximal"))
        log_w_b, log_w_p, log_w = anchor_log_weights(e_b, e_p, logits_dtype(next(self.model.parameters()).dtype))
        return KLReference((behaviour, proximal), m, (log_w_b, log_w_p), log_w)


def _is_peft(module) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (read without importing peft: full fine-tuning never pays it)."""
    return hasattr(module, "disable_adapter") and hasattr(module, "get_base_model")


def empty_like(batch: TrainBatch) -> TrainBatch:
    """The first row of ``batch`` with no valid token: a micro-batch that contributes nothing."""
    mb = batch.select(slice(0, 1))
    mb.packed.response_mask = torch.zeros_like(mb.packed.response_mask)
    return mb
