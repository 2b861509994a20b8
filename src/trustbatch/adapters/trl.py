"""A TRL ``GRPOTrainer`` whose loss is a trustbatch objective (TRL 1.16; ``pip install trustbatch[trl]``).

    from trustbatch.adapters.trl import TrustbatchGRPOTrainer
    trainer = TrustbatchGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                    objective="p3o", objective_options={"kl": "k3"})
    trainer.train()

Everything but the loss is TRL's: generation (transformers or vLLM), rewards, group advantages,
the reference model, logging, checkpoints. The loss of each micro-batch TRL hands ``compute_loss`` is
``trustbatch.objectives.get(objective)`` on:

- **logprobs**: TRL's per-token log-probs of the completion under π_θ (``_get_per_token_logps_and_entropies``,
  TRL's temperature applied), [B, T];
- **behaviour log-probs**: ``sampling_per_token_logps`` when vLLM produced them (the policy that
  sampled), else ``old_per_token_logps`` (TRL's recomputation at the rollout's parameters, present
  when the rollout is reused or lags), else the detached log-probs themselves (on-policy: ratio 1).
  vLLM tokens without a log-prob (NaN) take the trainer's value, ratio 1, as TRL does;
- **advantages**: TRL's, [B] or [B, T]; **mask**: ``completion_mask`` (× ``tool_mask``);
- **normaliser**: TRL's global token count ``num_items_in_batch`` (every process, the whole
  generation batch) rescaled to one accumulation window as TRL's ``dapo``/``cispo`` losses do, so
  the micro-batches of a window and the processes add up to the token mean of the window.
  Sequence aggregations divide by the window's rows (``per_device_train_batch_size`` × accumulation steps).
- **ESS scope**: ``ess_scope="batch"`` (default, trustbatch's choice): the ESS of every micro-batch of the
  accumulation window on every process. With one micro-batch per window it is all-reduced from the
  loss's own forward; with several, a no-grad pre-pass over the window's buffered micro-batches computes it
  before the first backward (one extra forward of the window; needs ``steps_per_generation`` to be
  a multiple of ``gradient_accumulation_steps``). ``ess_scope="micro_batch"``: each micro-batch on its own
  (the reference code's choice), no extra pass.

TRL's vLLM importance-sampling correction (``vllm_importance_sampling_correction``) is switched off:
every trustbatch objective takes its ratio against the policy that sampled (P3O caps and
KL-pulls toward it), so TRL's extra weight would correct twice. The trainer logs a warning when it
overrides a user's True. TRL's reference KL (``beta``) is carried over as trustbatch's
``ref_kl_coef`` with the k3 estimator TRL uses. TRL settings that reshape its own loss
(``top_entropy_quantile``, ``off_policy_mask_threshold``, sequence-level ``importance_sampling_level``,
``delta``, an entropy bonus, ``use_bias_correction_kl``, the MoE router aux loss) are refused at construction.

trustbatch's metrics (``ess``, ``cap_fraction``, ``kl_weight``, ``clip_fraction``, ...) go to TRL's
metrics as ``trustbatch/<key>``, averaged over processes, next to TRL's ``entropy`` (and ``kl``).
The vLLM paths are untested here (no GPU): the tests run TRL's transformers generation on CPU.
"""

from __future__ import annotations

import copy
import logging

import torch

from .. import objectives
from ..errors import UserError
from ..objectives import RatioStats
from ._common import METRIC_PREFIX, check_objective, default_aggregation, ess_kwargs, import_stack

trl = import_stack("trl", "trl")

logger = logging.getLogger(__name__)
ESS_SCOPES = ("batch", "micro_batch")
# options TRL decides: its reference KL is beta times the k3 estimator (the objective's ref_kl would be overridden)
TRL_FIXED = {"ref_kl": "the reference KL is GRPOConfig.beta with TRL's k3 estimator"}
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def behaviour_logprobs(inputs: dict, logprobs: torch.Tensor) -> torch.Tensor:
    """log π_b [B, T] for a TRL micro-batch: vLLM's sampling log-probs, else TRL's old ones, else ``logprobs``.

    ``logprobs`` [B, T] is the trainer's current value (detached here); it fills vLLM's NaN tokens.
    """
    current = logprobs.detach()
    old = inputs.get("old_per_token_logps")
    fallback = current if old is None else old
    sampled = inputs.get("sampling_per_token_logps")
    if sampled is None:
        return fallback
    return torch.where(torch.isnan(sampled), fallback, sampled)


def trl_objective_loss(name: str, logprobs: torch.Tensor, inputs: dict, options: dict, *,
                       grad_accum_steps: int, steps_per_generation: int, num_processes: int,
                       ess: RatioStats | None = None, ess_scope: str = "batch",
                       ref_kl_coef: float = 0.0) -> objectives.ObjectiveOutput:
    """The adapter's loss of one TRL micro-batch: ``objectives.get(name)`` with TRL's inputs and normaliser.

    Args:
        name: a trustbatch objective that needs no proximal snapshot.
        logprobs: [B, T] log π_θ of the completion tokens (nats), with gradient.
        inputs: TRL's micro-batch dict: ``completion_mask`` [B, T], ``advantages`` [B] or [B, T],
            ``num_items_in_batch`` (global valid tokens of the generation batch), optional
            ``tool_mask``, ``old_per_token_logps``, ``sampling_per_token_logps``, ``ref_per_token_logps``.
        options: checked user options (``check_objective``).
        grad_accum_steps, steps_per_generation, num_processes: TRL's; in eval pass 1 and 1
            (no split, no accumulation) and the process count.
        ess: the batch ``RatioStats`` for ``ess_scope="batch"`` (None: this micro-batch's own).
        ref_kl_coef: TRL's ``beta``; > 0 needs ``ref_per_token_logps``.

    Returns:
        ObjectiveOutput whose loss, summed over the window's micro-batches and averaged over
        processes (DDP), is the objective's loss of the whole window with the token mean over
        ``num_items_in_batch · grad_accum_steps / steps_per_generation`` tokens (TRL
        ``GRPOTrainer._compute_loss``, loss types dapo/cispo), or the sequence mean over
        ``B · grad_accum_steps`` rows per process for the seq_mean aggregations.

    Raises:
        ValueError: the objective's errors (shapes, non-finite values at valid positions).
    """
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    mask = mask.bool()
    kw = dict(options)
    kw["aggregation"] = agg = options.get("aggregation", default_aggregation(name))
    if ref_kl_coef:
        kw.update(ref_kl_coef=ref_kl_coef, ref_kl="k3", ref_logprobs=inputs["ref_per_token_logps"])
    if "ess" in objectives.spec(name).batch_stats:
        kw.update(ess_kwargs(name, ess_scope if ess is None or ess_scope == "micro_batch" else "batch"))
        if ess is not None and ess_scope == "batch":
            kw["ess"] = ess
    out = objectives.get(name)(logprobs, behaviour_logprobs(inputs, logprobs), inputs["advantages"], mask, **kw)
    # The objective normalises by this micro-batch's own count; rescaling gives TRL's window normaliser
    # and, unlike passing num_tokens, never falls below the micro-batch's count when TRL's window
    # estimate (generation batch × GA / SPG) is uneven.
    if agg == "token_mean":
        local = mask.sum().to(out.loss.dtype)
        window = torch.as_tensor(inputs["num_items_in_batch"], dtype=out.loss.dtype, device=out.loss.device)
        window = (window * grad_accum_steps / steps_per_generation).clamp_min(1.0)
        scale = local.clamp_min(1.0) * num_processes / window
    else:
        rows = (mask.sum(1) > 0).sum().to(out.loss.dtype)
        scale = rows.clamp_min(1.0) / (mask.shape[0] * grad_accum_steps)
    return objectives.ObjectiveOutput(loss=out.loss * scale, metrics=out.metrics)


class TrustbatchGRPOTrainer(trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with a trustbatch objective as its loss (see the module docstring).

    Args:
        objective: a trustbatch objective without a proximal snapshot: "p3o" (default), "grpo",
            "cispo", "dapo", "gspo", "reinforce".
        objective_options: its user options (``objectives.validate_options``), e.g. {"kl": "k3"}
            or {"eps_low": 0.2, "eps_high": 0.28}; default aggregation is the objective's own.
        ess_scope: "batch" (the accumulation window × processes) or "micro_batch".
        *args, **kwargs: ``trl.GRPOTrainer``'s (model, reward_funcs, args, train_dataset, ...);
            ``args.loss_type`` is not used.

    Raises:
        UserError: a bad objective, option or scope; a TRL setting the adapter does not carry over
            (named, with the fix); ``ess_scope="batch"`` with ``steps_per_generation`` not a
            multiple of ``gradient_accumulation_steps``.
    """

    def __init__(self, *args, objective: str = "p3o", objective_options: dict | None = None,
                 ess_scope: str = "batch", **kwargs):
        if ess_scope not in ESS_SCOPES:
            raise UserError(f"ess_scope={ess_scope!r} is not one of {ESS_SCOPES}")
        self.tb_objective = objective
        self.tb_options = check_objective(objective, objective_options, stack="TRL", fixed=TRL_FIXED)
        self.tb_ess_scope = ess_scope
        cfg = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if cfg is not None and cfg.vllm_importance_sampling_correction:
            if cfg.use_vllm:
                logger.warning("trustbatch: vllm_importance_sampling_correction switched off; %s takes its ratio "
                               "against the vLLM sampler itself", objective)
            cfg = copy.copy(cfg)  # the user's config object stays as given
            cfg.vllm_importance_sampling_correction = False
            if "args" in kwargs:
                kwargs["args"] = cfg
            else:
                args = (*args[:2], cfg, *args[3:])
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self._window_ess: RatioStats | None = None

    def _refuse_unsupported(self) -> None:
        a = self.args
        bad = [("top_entropy_quantile", self.top_entropy_quantile < 1.0, "1.0"),
               ("off_policy_mask_threshold", self.off_policy_mask_threshold is not None, "None"),
               ("importance_sampling_level", self.importance_sampling_level != "token", "'token'"),
               ("delta", getattr(a, "delta", None) is not None, "None"),
               ("entropy_coef", self._entropy_bonus_enabled, "0 (or trustbatch's entropy_coef needs entropies; not carried)"),
               ("use_bias_correction_kl", bool(self.beta) and bool(getattr(a, "use_bias_correction_kl", False)), "False"),
               ("router_aux_loss_coef", self.aux_loss_enabled, "0"),
               ("epsilon", a.epsilon != 0.2, "0.2 (the objective's clip is objective_options eps_low)"),
               ("epsilon_high", getattr(a, "epsilon_high", None) is not None,
                "None (the objective's clip is objective_options eps_high)")]
        for key, on, fix in bad:
            if on:
                raise UserError(f"TrustbatchGRPOTrainer: GRPOConfig.{key}={getattr(a, key, None)!r} reshapes TRL's own loss "
                                f"and is not carried over to {self.tb_objective!r}; set it to {fix}")
        if self.beta and "ref_kl_coef" in self.tb_options:
            raise UserError("TrustbatchGRPOTrainer: both GRPOConfig.beta and objective option ref_kl_coef set the reference "
                            "KL; keep one (beta is carried over as ref_kl_coef)")
        ga, spg = a.gradient_accumulation_steps, a.steps_per_generation
        if self.tb_ess_scope == "batch" and ga > 1 and spg % ga:
            raise UserError(f"ess_scope='batch' needs steps_per_generation ({spg}) to be a multiple of "
                            f"gradient_accumulation_steps ({ga}), so a window's micro-batches are buffered together; "
                            f"change one, or use ess_scope='micro_batch'")

    def _logprobs(self, model, inputs: dict, *, entropy: bool):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        extra = {k: inputs.get(k) for k in _FORWARD_KEYS}
        logps, ent, _ = self._get_per_token_logps_and_entropies(
            model, ids, att, inputs["completion_ids"].size(1), compute_entropy=entropy, **extra)
        return logps, ent

    def _uses_batch_ess(self) -> bool:
        return self.tb_ess_scope == "batch" and "ess" in objectives.spec(self.tb_objective).batch_stats

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        train = self.model.training
        ga = self.current_gradient_accumulation_steps if train else 1
        if self._uses_batch_ess() and ga > 1 and self._step % ga == 0:
            # No optimizer step happens inside a window, so these are the log-probs every micro-batch's
            # loss will see, and the ESS is known before the first backward.
            spg = self.args.steps_per_generation
            stats = RatioStats.zeros()
            with torch.no_grad():
                for k in range(self._step, self._step + ga):
                    mb = self._buffered_inputs[k % spg]
                    lp, _ = self._logprobs(self.model, mb, entropy=False)
                    m = mb["completion_mask"] * mb["tool_mask"] if "tool_mask" in mb else mb["completion_mask"]
                    stats = stats + RatioStats.from_logprobs(lp, behaviour_logprobs(mb, lp), m.bool(),
                                                             self.tb_options.get("log_ratio_clip", 20.0))
            self._window_ess = stats.all_reduce()
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("TrustbatchGRPOTrainer does not return outputs")
        train = self.model.training
        mode = "train" if train else "eval"
        ga = self.current_gradient_accumulation_steps if train else 1
        spg = self.args.steps_per_generation if train else 1
        logps, entropies = self._logprobs(model, inputs, entropy=True)
        ess = None
        if self._uses_batch_ess():
            if ga > 1:
                ess = self._window_ess
            else:
                m = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
                ess = RatioStats.from_logprobs(logps, behaviour_logprobs(inputs, logps), m.bool(),
                                               self.tb_options.get("log_ratio_clip", 20.0)).all_reduce()
        # Dr.GRPO's constant is the generation budget, as TRL's dr_grpo divides by (not the padded width)
        options = objectives.with_budget_constant(self.tb_options, self.args.max_completion_length)
        out = trl_objective_loss(self.tb_objective, logps, inputs, options, grad_accum_steps=ga,
                                 steps_per_generation=spg, num_processes=self.accelerator.num_processes, ess=ess,
                                 ess_scope=self.tb_ess_scope, ref_kl_coef=float(self.beta or 0.0))
        self._log_tb_metrics(mode, out.metrics, inputs, entropies)
        return out.loss

    def _log_tb_metrics(self, mode: str, metrics: dict, inputs: dict, entropies: torch.Tensor) -> None:
        keys = sorted(k for k in metrics if k != "loss")
        mask = inputs["completion_mask"].to(entropies.dtype)
        if "tool_mask" in inputs:  # as TRL's entropy and the loss: tool outputs are no completion tokens
            mask = mask * inputs["tool_mask"].to(entropies.dtype)
        # entropy and kl as TRL's global_masked_mean: token sums and counts over processes (kl_ref is this
        # micro-batch's token mean over the same mask)
        kl = float(metrics["kl_ref"]) if self.beta and "kl_ref" in metrics else 0.0
        sums = torch.stack([(entropies * mask).sum(), mask.sum(), kl * mask.sum()]).detach()
        vals = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=sums.device)
        vals = self.accelerator.reduce(vals, reduction="mean")
        sums = self.accelerator.reduce(sums, reduction="sum")
        for k, v in zip(keys, vals.tolist()):
            self._metrics[mode][METRIC_PREFIX + k].append(v)
        self._metrics[mode]["entropy"].append(float(sums[0] / sums[1].clamp_min(1.0)))
        if self.beta and "kl_ref" in metrics:
            self._metrics[mode]["kl"].append(float(sums[2] / sums[1].clamp_min(1.0)))
