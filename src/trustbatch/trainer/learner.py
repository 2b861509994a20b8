"""The learner: owns the policy version and the optimizer; turns a rollout batch into optimizer steps.

``train_on(batch)`` runs ``epochs × minibatches`` optimizer steps (replay when more than one), after
taking the proximal snapshot an objective declares it needs. ``step(batch)`` is one optimizer step in
micro-batches with a global token mean: a plan (``_plan``: global counts, micro-batches, the batch statistics they
share), one ``_micro_step`` each, and the metrics reduced over micro-batches and ranks as the objective's spec
declares (``ObjectiveSpec.metrics``, ``objectives.MetricReducer``). The forward passes without gradient live in
``trainer.passes``.

What an objective needs comes from its registration (``objectives.spec``), never from its name:
``batch_stats`` lists the ``RatioStats`` keywords ("ess": π_θ/π_b, "ess_proximal": π_θ/π_prox) that
must cover the whole optimizer batch. When the batch is split into micro-batches or ranks, a
no-grad pass accumulates them (Σρ, Σρ², n in float64) over every micro-batch and rank before the
first backward; with one micro-batch on one rank the loss computes the same values itself.
Options that need full distributions (``spec.needs_full_logprobs``, e.g. P3O's kl="exact") make the
learner compute the exact KL inside its LM head, chunk by chunk, and pass it per token (``kl_exact``), against the
behaviour distribution rebuilt from the batch's behaviour models (``TrainBatch.behaviour``, by policy version:
the engine's module, a foreign model; the learner's own module is frozen for the batch, by a copy when it takes
several optimizer steps), teacher-forced without gradient per micro-batch; for the two-anchor variant against
the mixture with the proximal snapshot rebuilt the same way, weighted by the batch ESS (then always taken in a
no-grad pass first). An objective that does not take ``kl_exact`` gets the learner's [B, C, V] log-softmax and
the rebuilt ones, per micro-batch. Rows of an engine that returns only its top-k log-probs (``policy.forward.TopK``:
vLLM) get the top-k lower bound on that KL instead (``objectives.kl.top_k_kl_lower_bound``), and the step's
``kl_behavior`` is then logged as ``kl_behavior_bound``.

A reference KL (the objective's ``ref_kl_coef`` > 0, TRL's ``beta``, verl's ``use_kl_loss``) is taken against a frozen
reference policy (``reference``: the initial policy by default; under LoRA the base with the adapters disabled): its
log-probs of the sampled tokens are computed once per batch at the start of ``train_on``, through the same forward and
chunked LM head without gradient, and stored per token (``TrainBatch.ref_logprobs`` [B, C]); the objective adds
ref_kl_coef · k(log π_θ − log π_ref) per token and reports ``kl_ref``. An entropy bonus (``entropy_coef`` > 0) takes
π_θ's entropy from the same head with its gradient (``entropy_grad``); without it the forward and backward are as
before, bit for bit.

Log-probs come from the LM head applied ``logprob_chunk_size`` tokens (rows × columns) at a time
(``policy.chunked_logprobs``): no [B, C, V] logits of the policy are kept for backward, and none of the
behaviour's or the proximal snapshot's exist (each chunk's are recomputed from hidden states and freed).

Data parallel (``trustbatch.parallel``): every rank receives the same global batch and trains on its
shard; token counts and statistics are summed over ranks, each rank's loss is multiplied by the
world size (DDP and FSDP2 average gradients), and every rank runs the same number of micro-batches
(empty ones padded in), so no collective is left waiting. Under FSDP2 (``strategy="fsdp2"``) that holds
for the no-grad passes too (each forward all-gathers weights), the shared-prompt forward is off (it runs
one or two forwards depending on the micro-batch), and ``state_dict`` gathers the whole optimizer state
(every rank calls it; rank 0 gets it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import objectives
from ..errors import UserError
from ..objectives import MetricReducer, RatioStats
from ..objectives.clipped import GRPO_ZEROED_METRICS, grpo_zeroed_shares
from ..objectives.metrics import merged
from ..pipeline.batch import TrainBatch
from ..policy.budget import logit_tokens, vocab_size
from ..policy.compile import compile_blocks
from ..policy.forward import TopK, response_logprobs, teacher_forced, trimmed
from ..policy.model import enable_activation_checkpointing, has_dropout
from ..policy.packed import packed_response_logprobs, packed_teacher_forced
from ..policy.shared_prompt import grouped_response_logprobs
from ..parallel import World, full_optimizer_state, is_sharded, load_full_optimizer_state
from .schedule import lr_multiplier
from .passes import ForwardPasses, empty_like

# what the learner adds to the objective's metrics: the entropy of π_θ per valid token (from its forward)
# kl_behavior_bound: an objective's kl_behavior where the batch's behaviour KL is the top-k lower bound (a TopK engine)
_LEARNER_METRICS = {"entropy": objectives.TOKEN_MEAN, "kl_behavior_bound": objectives.TOKEN_MEAN}


@dataclass
class _StepPlan:
    """One optimizer step's layout (``Learner._plan``), the same on every rank where it is summed."""

    n_tokens: float  # valid tokens over every micro-batch and rank: the loss's token-mean denominator
    n_seqs: float  # non-empty rows over every micro-batch and rank
    chunks: list[slice]  # this rank's micro-batches
    n_chunks: int  # the most micro-batches any rank has: every rank runs as many
    shared: dict = field(default_factory=dict)  # keywords every micro-batch's objective call takes (batch stats, scope)
    per_micro_batch_stats: bool = False  # "micro_batch" ESS scope over several ranks: summed per micro-batch


class NonFiniteTraining(UserError):
    """``max_bad_steps`` optimizer steps in a row had a non-finite loss or gradient norm."""


def _forward_functions(shared_prompt: bool, padding_free: bool, trim: bool, chunk_size: int | None,
                       temperature: float = 1.0):
    """The learner's two forwards: ``(model, packed, with_entropy=, ...) -> (logp [B, C], entropy or None, ...)``
    with gradient, and ``(packed, [(rows, Teacher)]) -> TeacherForced``, the behaviour and proximal models' no-grad
    forward laid out as the learner's own. ``shared_prompt``: each distinct prompt of a micro-batch runs once
    (``policy.shared_prompt``, falling back by itself); ``padding_free``: packed rows (``policy.packed``);
    ``trim``: each micro-batch at its own longest lengths (``forward.trimmed``); ``temperature``: π_θ's, dividing the
    logits of the first."""
    if padding_free:
        return (functools.partial(packed_response_logprobs, chunk_size=chunk_size, share_prompts=shared_prompt,
                                  temperature=temperature),
                functools.partial(packed_teacher_forced, share_prompts=shared_prompt))
    base = grouped_response_logprobs if shared_prompt else response_logprobs
    forward = functools.partial(base, chunk_size=chunk_size, temperature=temperature)
    return (trimmed(forward) if trim else forward), teacher_forced


class Learner(ForwardPasses):
    """Owns the policy's optimizer and version, and applies the configured objective.

    Args:
        model: the policy module (trained in place; engines that share it see every update).
        objective: a registered objective name (``trustbatch.objectives.names()``).
        options: keyword options for the objective (validated by ``objectives.validate_options``).
        ess_scope: the tokens a declared batch statistic covers: "batch" (every micro-batch and rank
            of the optimizer step), "micro_batch" (each micro-batch, summed over ranks) or
            "sequence" (per row; the objective computes it). Must be in the objective's ``ess_scopes``
            when it declares batch statistics; ignored otherwise.
        epochs, minibatches: ``train_on`` makes epochs × minibatches optimizer steps per batch.
        world: the data-parallel world (default: one process).
        version: the policy version to start from (optimizer steps taken; restored on resume).
        max_bad_steps: consecutive optimizer steps with a non-finite loss or gradient norm that are
            skipped (counted in ``nonfinite_skipped``) before ``NonFiniteTraining`` stops the run.
        shared_prompt: run each distinct prompt of a micro-batch once and reuse its key/value cache
            for its completions (``policy.shared_prompt``; the same log-probs and gradient; falls
            back to the plain forward where a model cannot share a cache). False: the plain forward.
        trim_micro_batches: run each micro-batch at its own longest sequence and completion rather
            than the batch's (``forward.trimmed``: the same log-probs up to float summation order;
            a saving only when micro-batches split a batch of unequal lengths).
        padding_free: run each micro-batch as packed rows of its real tokens (``policy.packed``: restarting
            ``position_ids``, and with ``shared_prompt`` each distinct prompt once under a prefix-tree mask), rows
            no longer than its longest sequence; the same log-probs and gradient up to float summation order.
            Replaces ``trim_micro_batches`` (nothing is left to trim).
        logprob_chunk_size: tokens (rows × completion columns) per LM-head chunk
            (``policy.chunked_logprobs``): no chunk holds more than this many positions' [tokens, V]
            logits; "auto": ``policy.budget.logit_tokens(V)``, 256 MiB of float32 logits (441 tokens
            at V = 151,936). A micro-batch of B rows and width C with B · (C + 1) ≤ logprob_chunk_size,
            or None: the full path, op for op as before.
        precision: "float32", or "bf16-mixed": every forward of the learner runs under bf16 autocast
            (matrix products in bf16) while the weights, gradients and AdamW state stay float32
            (Lightning's ``bf16-mixed``). The log-probs that feed ratios, ESS and KL are still float32
            (the forwards upcast the logits before the log-softmax; scale-up.md invariant 1).
        activation_checkpointing: recompute each decoder layer's activations in backward
            (``policy.model.enable_activation_checkpointing``: transformers' own, non-reentrant). The
            shared-prompt forward then falls back to the plain one (checkpointed layers drop the cache).
        compile_backend: compile each decoder block's training forward with this ``torch.compile`` backend
            (``policy.compile.compile_blocks``: "inductor" for ``train.compile``; no-grad forwards stay eager), or
            None. The shared-prompt forward then falls back to the plain one (its cache would compile a graph
            per layer).
        temperature: π_θ's temperature, > 0: every log-prob of the policy (and of the reference and proximal
            snapshot) is of softmax(logits / temperature); 1 scores the policy itself, so a batch sampled at
            another temperature is off-policy data (the P3O paper's temperature shift); the sampling temperature
            scores as TRL and verl do (their ratio on a fresh batch is 1).
        diagnostics: also log, at every optimizer step, the share of tokens GRPO's clip would zero
            (``objectives.clipped.grpo_zeroed_shares``, whatever the objective; the lab sets it).
        lr_schedule, warmup_steps, total_steps: the learning-rate multiplier per optimizer step
            (``trainer.schedule.lr_multiplier``: warm-up, then constant, linear or cosine decay to 0 at total_steps).
        betas, eps, weight_decay: AdamW's (``torch.optim.AdamW``).
        reference: the frozen reference policy of the reference KL (the objective's ``ref_kl_coef`` > 0; ignored
            otherwise): a causal LM with the policy's output vocabulary, frozen, in eval mode, moved to the
            learner's device and under FSDP2 sharded as the policy; or the ``peft.PeftModel`` wrapping a LoRA
            ``model`` (``policy.adapter``): the base with the adapters disabled (peft's ``disable_adapter()``), no
            second copy of the weights. None: a copy of ``model`` as it is now, the initial policy (a LoRA model
            must pass its PeftModel instead). Its log-probs are taken once per batch (``reference_logprobs``).

    The learner trains on the device its model's parameters are on (the recipe moves the model there);
    batches are moved to it.
        strategy: data parallelism over several ranks, "ddp" or "fsdp2" (``World.wrap``).
        param_dtype: FSDP2's compute dtype for weights (e.g. torch.bfloat16; float32 master weights and
            gradient reduction); None computes in the weights' dtype.

    Raises:
        ValueError: an unknown objective, invalid options, or a scope the objective does not support; an
            unknown precision; a model without activation checkpointing when it is asked for, or without decoder
            blocks when compiling, or an unknown compile backend; a reference of
            another vocabulary size, a peft model of another module, or a LoRA model without its peft model.
    """

    def __init__(self, model: torch.nn.Module, objective: str, options: dict | None = None, *, lr: float = 1e-3,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, micro_batch_size: int = 256,
                 ess_scope: str = "batch", warmup_steps: int = 0, epochs: int = 1, minibatches: int = 1,
                 world: World | None = None, version: int = 0, max_bad_steps: int = 3, shared_prompt: bool = True,
                 trim_micro_batches: bool = True, precision: str = "float32", activation_checkpointing: bool = False,
                 logprob_chunk_size: int | str | None = "auto", strategy: str = "ddp", param_dtype: torch.dtype | None = None,
                 diagnostics: bool = False, lr_schedule: str = "constant", total_steps: int = 0,
                 betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
                 padding_free: bool = False, reference: torch.nn.Module | None = None,
                 compile_backend: str | None = None, temperature: float = 1.0):
        if precision not in ("float32", "bf16-mixed"):
            raise ValueError(f"precision must be 'float32' or 'bf16-mixed', not {precision!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.temperature = temperature
        self.model = model
        self.device = next(model.parameters()).device
        self.precision = precision
        self.spec = objectives.spec(objective)
        # full behaviour log-probs come with the batch (step() refuses a batch without them); the reference's
        # log-probs and π_θ's entropy the learner computes
        self.options = objectives.validate_options(objective, dict(options or {}), supplied=objectives.LEARNER_SUPPLIED)
        self.full = self.spec.needs_full_logprobs(self.options)
        # the exact KL is computed in the LM head's chunks; π_mix's weights need the batch ESS before it
        self.kl_in_head = self.full and self.spec.takes_kl_exact
        self.kl_needs_ess = self.kl_in_head and self.spec.needs_proximal
        # a training forward with dropout is a random sample of the policy: the batch ESS is then always the no-grad
        # pass's, as with several micro-batches (one micro-batch took its own, moving with micro_batch_size)
        self.stochastic = has_dropout(model)
        self.diagnostics = diagnostics
        self.reductions = merged(self.spec.metrics, _LEARNER_METRICS, GRPO_ZEROED_METRICS if diagnostics else {})
        if logprob_chunk_size == "auto":
            logprob_chunk_size = logit_tokens(vocab_size(model))
        elif logprob_chunk_size is not None and (not isinstance(logprob_chunk_size, int) or logprob_chunk_size < 1):
            raise ValueError(f"logprob_chunk_size must be >= 1, 'auto' or None, got {logprob_chunk_size!r}")
        self.logprob_chunk_size = logprob_chunk_size
        if self.spec.batch_stats and ess_scope not in self.spec.ess_scopes:
            raise ValueError(f"objective {objective!r} supports ess_scope {self.spec.ess_scopes}, not {ess_scope!r}")
        self.ess_scope = ess_scope
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.epochs, self.minibatches = epochs, minibatches
        self.world = world or World()
        # ref_kl_coef's frozen reference (None without): copied and sharded before the policy is wrapped
        self.reference = self._take_reference(reference, strategy, param_dtype)
        self.entropy_grad = bool(self.options.get("entropy_coef"))  # an entropy bonus: the head's entropy with gradient
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        if compile_backend is not None:
            compile_blocks(model, compile_backend)
        self.wrapped = self.world.wrap(model, strategy, param_dtype=param_dtype)
        self.sharded = is_sharded(self.wrapped)
        if self.sharded and self.full and self.spec.needs_proximal:
            # the proximal model is the sharded module: its no-grad forwards would differ in number between ranks
            raise ValueError(f"objective {objective!r} with {self.spec.full_logprobs_cause(self.options)} does not run "
                             "under train.strategy=fsdp2; use train.strategy=ddp or kl='k3'")
        # FSDP2 all-gathers a block's weights at each of its forwards, so every rank must run as many;
        # the shared-prompt forward runs one or two depending on the micro-batch's prompts. A compiled block would
        # guard on the shared-prompt cache's per-layer state: one graph per layer, eager past dynamo's recompile limit
        share = shared_prompt and not self.sharded and compile_backend is None
        self.forward_fn, self.teacher_forced = _forward_functions(share, padding_free, trim_micro_batches,
                                                                  logprob_chunk_size, temperature)
        self.version = version
        self.max_bad_steps = max_bad_steps
        self.bad_steps = 0  # consecutive skipped steps
        # called as fn(version, model) after every optimizer step (e.g. the lagged weight sync's snapshots)
        self.on_step: list[Callable[[int, torch.nn.Module], None]] = []
        # called as fn(opt_step, epoch, minibatch, log_ratio) before every optimizer step of train_on, with
        # log π_θ/μ over this rank's valid tokens of that step's mini-batch ([N], float32, π_θ before the step),
        # taken from the log-probs the loss already computed (no extra forward): how a replayed batch drifts
        self.on_step_ratios: list[Callable[[int, int, int, torch.Tensor], None]] = []
        self._step_tag: tuple[int, int, int] | None = None
        # the last train_on's optimizer steps, one metrics dict each with opt_step, epoch and minibatch: the
        # per-step traces of a replayed round, which the round's record (their mean) hides
        self.step_records: list[dict[str, float]] = []
        self._pad: TrainBatch | None = None
        self._snapshot: torch.nn.Module | None = None  # the policy frozen for this train_on (passes._frozen_policy)
        # only what trains: with LoRA (policy.lora) the adapters, the frozen base has neither grads nor Adam state
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_multiplier(lr_schedule, warmup_steps, total_steps))

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimizer (``Optimizer.state_dict()`` format, whole tensors), scheduler, policy version, bad steps.
        Under FSDP2 every rank must call it; rank 0 gets the gathered optimizer state, the others {}."""
        optimizer = full_optimizer_state(self.model, self.optimizer) if self.sharded else self.optimizer.state_dict()
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "policy_version": self.version, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.sharded:  # a state saved at any world size; every rank loads it and keeps its shard
            load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the saved rate is the old schedule's next one; a resume that changes train.steps moves the decay's end, so
        # the next step's rate is this run's schedule at that step (the lambdas are this run's: closures are not saved)
        s = self.scheduler
        for group, base, f in zip(self.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
            group["lr"] = base * f(s.last_epoch)
        s._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.version = int(state["policy_version"])
        self.bad_steps = int(state.get("bad_steps", 0))

    def close(self) -> None:
        """Nothing to release: the module and optimizer live in this process (``LearnerProtocol``)."""

    # ---- optimizer steps -----------------------------------------------------------------------
    def train_on(self, batch: TrainBatch, *,
                 stop_before: Callable[[int, TrainBatch], bool] | None = None) -> dict[str, float]:
        """``epochs × minibatches`` optimizer steps on ``batch`` (this rank's shard of it).

        Each epoch splits one permutation of the whole batch (rank 0's draw, shared) into the mini-batches, so that
        each step trains on the rows it would in one process; a rank takes the rows of its shard among them (a
        number that may differ between ranks, or be none).

        The proximal snapshot (π_θ before this batch's updates) is taken first when the objective
        declares ``needs_proximal``, and the reference's log-probs (``reference_logprobs``) with a reference KL.
        Returns the steps' metrics averaged (``nonfinite_skipped`` summed), plus ``optimizer_steps``.

        stop_before: called as fn(opt_step, mini_batch) before each optimizer step (opt_step counts from 0
            within this call; mini_batch is the ``TrainBatch`` that step would train on, on the learner's
            device, with its proximal snapshot); True ends ``train_on`` there, without that step (the lab's
            pre-flight measures the batch of a round's last step this way).
        """
        shard = self.world.shard(len(batch))  # all of it on one rank
        local = batch.select(shard) if self.world.size > 1 else batch
        local = local.to(self.device)
        self._pad = empty_like(batch).to(self.device)  # the global batch: a rank's shard may be empty
        self._snapshot = None
        if self.full:
            self._own_teachers(local)
        if self.spec.needs_proximal:
            self._take_proximal(local)
        if self.reference is not None:
            local.ref_logprobs = self.reference_logprobs(local)
        step_metrics = []
        self.step_records = []
        for _epoch in range(self.epochs):
            # one permutation of the whole batch, rank 0's (as one process draws it), so that a mini-batch holds the
            # rows it would hold in one process: each rank trains on those of its shard, as many as they are
            perm = torch.randperm(len(batch))
            if self.world.size > 1:
                perm = torch.tensor(self.world.gather(perm.tolist())[0], dtype=torch.long)
            # `minibatches` pieces of sizes that differ by at most one (chunk gave fewer, e.g. 2+2+2 rows and an empty
            # step for 6 rows in 4), but never an empty one: a batch of fewer rows (DAPO's dynamic sampling kept few
            # groups) takes one step a row, as a step without rows would move the version and the LR schedule. The
            # count comes from the global batch, so every rank takes as many optimizer steps, even with fewer rows
            pieces = list(torch.tensor_split(perm, max(1, min(self.minibatches, len(batch)))))
            for mb_index, piece in enumerate(pieces):
                mine = piece[(piece >= shard.start) & (piece < shard.stop)]
                mini = local.select(mine - shard.start)
                if stop_before is not None and stop_before(len(step_metrics), mini):
                    return _over_steps(step_metrics, self.reductions)
                self._step_tag = (len(step_metrics), _epoch, mb_index)
                try:
                    step_metrics.append(self.step(mini))
                finally:
                    self._step_tag = None
                self.step_records.append({"opt_step": len(step_metrics) - 1, "epoch": _epoch, "minibatch": mb_index,
                                          **step_metrics[-1]})
        self._snapshot = None
        return _over_steps(step_metrics, self.reductions)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``: metrics reduced over micro-batches and ranks as the objective declares.

        A step whose loss or gradient is not finite (the objective raises ValueError on a non-finite
        loss or gradient; a NaN or inf gradient norm) is skipped: no update, the version stays, and
        ``nonfinite_skipped`` is 1. All ranks skip together; a refusing rank still runs its whole backward (zero
        gradient), so it reaches the others' collectives (``objectives.deferred_grad_refusals``).

        Raises:
            ValueError: the objective needs proximal log-probs and the batch has none.
            NonFiniteTraining: ``max_bad_steps`` consecutive steps were skipped.
            KeyError: the objective reports a metric it declares no reduction for (``ObjectiveSpec.metrics``).
        """
        self.model.train()
        batch = batch.to(self.device)
        if self.reference is not None and batch.ref_logprobs is None:  # a step outside train_on
            batch = dataclasses.replace(batch, ref_logprobs=self.reference_logprobs(batch))
        plan = self._plan(batch)
        reducer = MetricReducer(self.reductions, self.spec.name)
        failure = ""
        record_ratios = bool(self.on_step_ratios) and self._step_tag is not None
        step_log_ratios: list[torch.Tensor] = []
        # an objective whose ess is its call's own (no batch ESS declared) logs the step's, pooled from its calls'
        pool_ess = "ess" not in self.spec.batch_stats and "ess" in self.reductions
        step_stats = RatioStats.zeros()
        # the whole batch's engines (every rank's shard keeps them): every rank names the metric alike
        bound = self.full and any(isinstance(t, TopK) for t in batch.behaviour.values())
        for i in range(plan.n_chunks):
            skip_sync = World.no_sync(self.wrapped, skip=i < plan.n_chunks - 1)
            if i >= len(plan.chunks) or failure:
                self._empty_micro_step(batch, plan, skip_sync)
                continue
            mb = batch.select(plan.chunks[i])
            m = mb.packed.response_mask
            out, logp, ent = self._micro_step(mb, plan, skip_sync)
            if isinstance(out, str):
                failure = out
                continue
            step_log_ratios.append((logp.detach() - mb.behavior_logprobs)[m].float())  # to the host once, per step
            if pool_ess:
                step_stats = step_stats + self._ratio_stats(logp, mb.behavior_logprobs, m)
            w = float(m.sum())
            metrics = _named_as_bound(out.metrics) if bound else dict(out.metrics)
            metrics["entropy"] = float((ent.detach() * m).sum() / max(w, 1.0))
            if self.diagnostics:
                metrics.update(grpo_zeroed_shares(logp, mb.behavior_logprobs, mb.advantages, m))
            reducer.add(metrics, w)
        flat = self._step_ratios(step_log_ratios, record_ratios)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        if self.world.max([float(bool(failure) or not math.isfinite(grad_norm))])[0] > 0:
            return self._skip(failure or f"gradient norm {grad_norm}")
        lr = self._update()
        out = reducer.result(float(batch.packed.response_mask.sum()), self.world)
        out.update(self._ratio_quantiles(flat) if "ratio_p50" in out else {})  # collective: every rank
        if pool_ess:  # every rank: a sum over ranks
            ess = self._sum_stats({"ess": step_stats})["ess"].ess()[0]
            if "ess" in out:
                out["ess"] = ess
        return {**out, "grad_norm": grad_norm, "lr": lr, "nonfinite_skipped": 0.0}

    def _update(self) -> float:
        """Apply the accumulated gradient: the optimizer and schedule step, the version moves on, ``on_step`` runs.
        Returns the learning rate the step used (read before the schedule moves on)."""
        self.bad_steps = 0
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        for fn in self.on_step:
            fn(self.version, self.model)
        return lr

    def _ratio_quantiles(self, mine: torch.Tensor) -> dict[str, float]:
        """``ratio_p50`` and ``ratio_p99`` of the whole step: the quantiles (``objectives.quantiles``) of
        ρ = exp(clamp(log π_θ − log π_b, ±log_ratio_clip)), the ratio the objectives take them of, over the response
        tokens of every micro-batch (``mine``: this rank's, ``_step_ratios``) and rank. Each objective call's own
        quantiles, averaged over the calls, moved with ``micro_batch_size`` and ran low in the tail (p99 1.98 at 3
        rows a micro-batch against 2.52 over the step). Collective: every rank calls it."""
        flat = torch.cat(self.world.gather(mine)) if self.world.size > 1 else mine
        if flat.numel() == 0:
            return {}
        bound = float(self.options.get("log_ratio_clip", objectives.DEFAULT_LOG_RATIO_CLIP))
        q = objectives.quantiles(flat.clamp(-bound, bound).exp(), (0.5, 0.99))
        return {"ratio_p50": float(q[0]), "ratio_p99": float(q[1])}

    def _step_ratios(self, step_log_ratios: list[torch.Tensor], report: bool) -> torch.Tensor | None:
        """This step's token log-ratios (log π_θ − log π_b over the response tokens, float32 [tokens]), copied to the
        host once for both readers: the ``on_step_ratios`` callbacks (with the step's tag, when ``report``) and the
        step's ratio quantiles; None when neither reads them."""
        if not (report or "ratio_p50" in self.reductions):
            return None
        flat = torch.cat(step_log_ratios).cpu() if step_log_ratios else torch.zeros(0)
        for fn in self.on_step_ratios if report else ():
            fn(*self._step_tag, flat)
        return flat

    def _plan(self, batch: TrainBatch) -> "_StepPlan":
        """The step's global counts, micro-batches, and the batch statistics its micro-batches share; ValueError
        for a batch without the proximal snapshot or the full log-probs the objective needs."""
        if self.spec.needs_proximal and batch.proximal_logprobs is None:
            raise ValueError(f"objective {self.spec.name!r} needs proximal log-probs; use train_on, which takes them")
        if self.full and not batch.behaviour:
            raise ValueError(f"objective {self.spec.name!r} with {self.spec.full_logprobs_cause(self.options)} needs the "
                             "behaviour model, but the batch has none; build it with behaviour= (the engines' teacher)")
        world = self.world
        mask = batch.packed.response_mask
        n_tokens, n_seqs = world.sum([float(mask.sum()), float((mask.sum(1) > 0).sum())])
        chunks = self._chunks(len(batch))
        plan = _StepPlan(n_tokens, n_seqs, chunks, int(world.max([len(chunks)])[0]))
        if self.spec.batch_stats:
            if self.ess_scope == "batch" and (plan.n_chunks > 1 or world.size > 1 or self.kl_needs_ess
                                              or self.stochastic):
                plan.shared.update(self.batch_stats(batch, self.spec.batch_stats))
            elif self.ess_scope == "micro_batch" and world.size > 1:
                plan.per_micro_batch_stats = True
            if self.ess_scope != "batch":
                plan.shared["ess_scope"] = self.ess_scope
        return plan

    def _micro_step(self, mb: TrainBatch, plan: "_StepPlan", skip_sync):
        """Forward, objective and backward of one micro-batch: ``(ObjectiveOutput, logp [B, C], entropy [B, C])``,
        or ``(message, None, None)`` when the objective refused a non-finite loss or gradient."""
        m = mb.packed.response_mask
        with skip_sync:
            kw = dict(plan.shared)
            fw = dict(with_entropy=True, entropy_grad=self.entropy_grad)
            with self.autocast():
                ref = self._kl_reference(mb, kw) if self.full else None
                if self.kl_in_head:
                    logp, ent, kw["kl_exact"] = self.forward_fn(self.wrapped, mb.packed, kl_reference=ref, **fw)
                elif self.full:
                    logp, ent, kw["logprobs_full"] = self.forward_fn(self.wrapped, mb.packed, with_full=True, **fw)
                else:
                    logp, ent = self.forward_fn(self.wrapped, mb.packed, **fw)
            if self.entropy_grad:
                kw["entropy"] = ent
            if self.reference is not None:
                kw["ref_logprobs"] = mb.ref_logprobs
            if self.full and not self.kl_in_head:  # an objective without kl_exact: this micro-batch's [B, C, V]
                every, own = slice(None), kw["logprobs_full"].detach()  # a top-k behaviour's reference is built from own
                kw["behavior_logprobs_full"] = ref.logprobs[0].log_probs(every, own.dtype, own)
                if self.spec.needs_proximal:
                    kw["proximal_logprobs_full"] = ref.logprobs[1].log_probs(every, kw["logprobs_full"].dtype)
            if mb.proximal_logprobs is not None and self.spec.needs_proximal:
                kw["proximal_logprobs"] = mb.proximal_logprobs
            if plan.per_micro_batch_stats:
                kw.update(self._sum_stats(self._local_stats(logp, mb)))
            # A refusal must not stop this rank's backward halfway or skip it: under DDP and FSDP2 the other
            # ranks wait in the collectives it runs. The step is then skipped on every rank (``step``).
            with objectives.deferred_grad_refusals() as refused:
                try:
                    out = self.spec.fn(logp, mb.behavior_logprobs, mb.advantages, m, num_tokens=plan.n_tokens,
                                       num_sequences=plan.n_seqs, **kw, **self.options)
                except ValueError as e:  # a non-finite loss or input (objectives never return NaN silently)
                    if logp.requires_grad:
                        (logp.sum() * 0.0).backward()
                    return str(e).splitlines()[0], None, None
                (out.loss if self.world.size == 1 else out.loss * self.world.size).backward()
            if refused:  # a gradient beyond the log-probs' dtype
                return refused[0], None, None
        return out, logp, ent

    def _skip(self, cause: str) -> dict[str, float]:
        """Drop this step's gradient; stop the run after ``max_bad_steps`` in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_steps += 1
        if self.bad_steps >= self.max_bad_steps:
            raise NonFiniteTraining(
                f"{self.bad_steps} optimizer steps in a row (train.max_bad_steps={self.max_bad_steps}) had a non-finite "
                f"loss or gradient ({cause}); lower train.lr or raise train.grad_clip, and resume from the last checkpoint")
        return {"nonfinite_skipped": 1.0, "lr": self.scheduler.get_last_lr()[0]}


def _named_as_bound(metrics: dict) -> dict:
    """``metrics`` with ``kl_behavior`` renamed ``kl_behavior_bound``: at rows of a top-k engine the objective's exact
    KL is the top-k lower bound, which must not be read as the KL."""
    out = dict(metrics)
    if "kl_behavior" in out:
        out["kl_behavior_bound"] = out.pop("kl_behavior")
    return out


def _over_steps(step_metrics: list[dict], reductions: dict) -> dict[str, float]:
    """A round's metrics from its optimizer steps': a metric its objective declares ``MAX`` (``ratio_max``) is the
    largest of any step, skips are counted, and every other metric is averaged over the steps that report it (a
    skipped step reports few): a loss, a rate or a quantile per step, and ``num_tokens`` the tokens of one step."""
    keys = list(dict.fromkeys(k for s in step_metrics for k in s))
    m = {}
    for k in keys:
        vals = [s[k] for s in step_metrics if k in s]
        if k == "nonfinite_skipped":
            m[k] = sum(vals)
        elif reductions.get(k) == objectives.MAX:
            m[k] = max(vals)
        else:
            m[k] = sum(vals) / len(vals)
    m["optimizer_steps"] = float(len(step_metrics))
    return m
