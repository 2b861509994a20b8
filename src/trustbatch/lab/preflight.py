"""Lab pre-flight: does an arm's behaviour shift make P3O and GRPO compute different updates at all?

For each arm of an experiment, at the base policy, one rollout batch is drawn by the arm's own rollout
source (``recipes.build.build_parts``: temperature, precision, engine, foreign data, lag) and three numbers
are measured on the batch that one optimizer step of the arm would train on:

- ``ess``: the normalized effective sample size of the token ratios ρ = π_θ/π_b over the batch
  (arXiv 2605.12380 Eq. 11; ``objectives.RatioStats``), 1 when π_θ = π_b;
- ``zeroed@ε``: the share of valid tokens whose GRPO clipped term has zero gradient, i.e. A > 0 and
  ρ > 1 + ε, or A < 0 and ρ < 1 − ε (PPO's clip, arXiv 1707.06347 Eq. 7; GRPO arXiv 2402.03300 Eq. 3),
  at ε = 0.2 and at the paper's ε = 0.4;
- ``cos@ε``: the cosine between the flattened parameter gradients the learner computes for P3O
  (Eq. 12) and for GRPO(ε) on that same batch;
- ``abs_log_ratio``: the mismatch itself, mean |log π_θ(y_t) − log π_b(y_t)| over valid tokens (0 when
  π_θ = π_b), the scale the clip's ε is set against (|log ρ| > log(1 + ε) can be zeroed).

The behaviour log-probs are the ones the arm's engine recorded while sampling. With ``rollout.engine:
vllm`` they are vLLM's own sampling log-probs (its processed log-probs: log_softmax in float32 of the
logits of vLLM's forward in ``rollout.precision``, e.g. bfloat16, with ``rollout.quantization``'s
weights), and π_θ is the float32 learner's recomputation: the real training-inference mismatch, where
``rollout.precision`` with the transformers engine emulates it.

With no shift (ρ ≡ 1): e_B = 1, so P3O's weight is min(1, 1) = 1 and its KL weight 1 − e_B = 0; GRPO's
clip is inactive at r = 1 and ∇(r·A) = A·∇log π_θ. Both are then −(1/N) Σ A_t ∇log π_θ(y_t): cosine 1.
An arm with cos > 0.99 and under 1 % zeroed (at both ε) is a control: no difference is expected there.

Where the shift needs training to show (a lag, replay), the pre-flight does that training with the arm's
own learner, so what it measures is a step the arm's run really takes:

- lag k (``rollout.staleness``): the base policy samples, the learner takes optimizer steps on it as the
  run does (``run_loop``) until the lag is full (⌈k/m⌉ rounds of m steps), and the next round is measured.
  At the base without those steps a lag changes nothing (π_{−k} = π_0).
- replay (epochs × minibatches = m > 1): the last optimizer step of the measured round, after m − 1 steps
  on the same batch.
- ``rollout.mode=async``: measured as the exact lag at its bound k (``max_staleness``; ``auto``: the
  controller's upper bound), which the real pipeline's lag (0 … k) never exceeds. No worker processes run.

The ``age`` column is measured from the batch's policy-version tags: the measured step's learner version
minus the oldest policy-sampled row's version.
"""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Config, load_config
from ..errors import UserError

EPSILONS = (0.2, 0.4)  # GRPO's usual clip and the paper's for its temperature and FP8 runs
PROBED = "p3o"  # the objective whose gradient is compared with GRPO's
CONTROL_COSINE = 0.99  # above it (at every ε) and ...
CONTROL_ZEROED = 0.01  # ... under this share zeroed (at every ε): the objectives compute the same update
CONTROL_LABEL = "control"  # no difference expected: a no-difference control, not a test of the claim
TEST_LABEL = "test"
CONTROL_RULE = (f"control (no difference expected): cos > {CONTROL_COSINE} and zeroed < {CONTROL_ZEROED:.0%} "
                "at every eps and every seed")


@dataclass
class Probe:
    """One arm × seed, measured at the step described in the module docstring."""

    arm: str
    seed: int
    shift: str
    age: int  # optimizer steps between the sampling policy and the measured step
    ess: float
    zeroed: dict[float, float]  # ε -> share of valid tokens GRPO(ε)'s clip zeroes
    cosine: dict[float, float]  # ε -> cos(∇P3O, ∇GRPO(ε))
    norm_ratio: dict[float, float]  # ε -> |∇P3O| / |∇GRPO(ε)|
    informative: float  # share of valid tokens with A ≠ 0 (the others carry no gradient in either)
    tokens: int
    response_length: float
    abs_log_ratio: float = math.nan  # mean |log π_θ − log π_b| over valid tokens (nats)

    @property
    def control(self) -> bool:
        return is_control(self.cosine, self.zeroed)

    def as_json(self) -> dict:
        return {"arm": self.arm, "seed": self.seed, "shift": self.shift, "age": self.age, "ess": self.ess,
                **{f"zeroed@{e}": v for e, v in self.zeroed.items()},
                **{f"cos@{e}": _finite(v) for e, v in self.cosine.items()},
                **{f"grad_norm_ratio@{e}": _finite(v) for e, v in self.norm_ratio.items()},
                "informative": self.informative, "tokens": self.tokens, "response_length": self.response_length,
                "abs_log_ratio": _finite(self.abs_log_ratio), "verdict": CONTROL_LABEL if self.control else TEST_LABEL}


def is_control(cosine: dict[float, float], zeroed: dict[float, float]) -> bool:
    """True when every ε gives cos > ``CONTROL_COSINE`` and a zeroed share < ``CONTROL_ZEROED`` (a NaN
    cosine is not > 0.99: an undefined comparison is never called a control)."""
    return all(c > CONTROL_COSINE for c in cosine.values()) and all(z < CONTROL_ZEROED for z in zeroed.values())


def learner_gradient(model: torch.nn.Module, batch, objective: str, options: dict | None = None, *,
                     micro_batch_size: int = 512, ess_scope: str = "batch",
                     temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The flattened parameter gradient ``[P]`` (float64) of one ``Learner.step`` on ``batch``, not applied.

    A throwaway ``Learner`` on ``model`` runs the step as training would (micro-batches, the global token
    mean, the batch ESS over every micro-batch, the shared-prompt forward); its optimizer's ``step`` is
    replaced by a recorder, so ``model`` is left unchanged. ``grad_clip`` is off, so the gradient is the
    raw one. ``temperature``: π_θ's in the loss (``Learner``'s). Returns ``(gradient, the step's metrics)`` (e.g.
    ``ess``, ``clip_fraction``, ``grad_norm``).

    Raises:
        ValueError: the objective rejected the batch (a non-finite loss or gradient), so no step was taken.
    """
    from ..trainer.learner import Learner

    learner = Learner(model, objective, options, lr=1.0, grad_clip=math.inf, micro_batch_size=micro_batch_size,
                      ess_scope=ess_scope, temperature=temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    got: list[torch.Tensor] = []

    def record(*_a, **_k):
        got.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                              for p in params]))

    learner.optimizer.step = record
    with warnings.catch_warnings():  # the scheduler notices that the real optimizer.step never ran
        warnings.simplefilter("ignore", UserWarning)
        metrics = learner.step(batch)
    if not got:
        raise ValueError(f"{objective}: the step was skipped ({metrics}); no gradient to compare")
    return got[0], metrics


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) in float64; 1.0 when both are zero (the same, empty, update), NaN when only one is (undefined:
    e.g. a batch with no informative group, where GRPO has no gradient and P3O only its KL pull)."""
    na, nb = float(a.double().norm()), float(b.double().norm())
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else math.nan
    return float(a.double() @ b.double()) / (na * nb)


def probe_batch(model: torch.nn.Module, batch, *, p3o_options: dict | None = None, ess_scope: str = "batch",
                micro_batch_size: int = 512, epsilons=EPSILONS, temperature: float = 1.0) -> dict:
    """ESS, GRPO's zeroed share and the P3O–GRPO gradient cosine on one batch at the model's current θ.

    Args:
        model: the policy (left unchanged).
        batch: a ``TrainBatch`` (``behavior_logprobs`` [B, C], ``advantages`` [B], mask [B, C]).
        p3o_options, ess_scope: P3O's options (e.g. ``kl``) and ESS scope, as the arm trains it.
        epsilons: GRPO clip widths (eps_low = eps_high = ε).
        temperature: π_θ's in the loss, as the arm trains (``objective.temperature``).

    Returns:
        ``{"ess", "zeroed": {ε: share}, "cosine": {ε: cos}, "norm_ratio": {ε: |∇P3O|/|∇GRPO|},
        "informative", "tokens", "abs_log_ratio"}``; ``ess`` is the batch ESS (Eq. 11) whatever the scope,
        shares are of valid tokens, ``abs_log_ratio`` the mean |log π_θ − log π_b| over them (nats).

    Raises:
        ValueError: an objective rejected the batch.
    """
    from ..objectives import DEFAULT_LOG_RATIO_CLIP, RatioStats
    from ..policy.forward import response_logprobs

    mask = batch.packed.response_mask
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch.packed, temperature=temperature)
        ess = RatioStats.from_logprobs(logp, batch.behavior_logprobs, mask,
                                       log_ratio_clip=(p3o_options or {}).get("log_ratio_clip", DEFAULT_LOG_RATIO_CLIP)).ess()[0]
        valid = mask.bool()
        gap = (logp.double() - batch.behavior_logprobs.double())[valid].abs()
    g_p3o, _ = learner_gradient(model, batch, PROBED, p3o_options, micro_batch_size=micro_batch_size,
                                ess_scope=ess_scope, temperature=temperature)
    zeroed, cos, ratio = {}, {}, {}
    for eps in epsilons:
        g, m = learner_gradient(model, batch, "grpo", {"eps_low": eps, "eps_high": eps},
                                micro_batch_size=micro_batch_size, temperature=temperature)
        zeroed[eps] = float(m["clip_fraction"])
        cos[eps] = cosine(g_p3o, g)
        ratio[eps] = float(g_p3o.norm() / g.norm()) if float(g.norm()) > 0 else math.nan
    n = float(mask.sum())
    adv = batch.advantages.reshape(-1, 1).expand_as(mask)
    informative = float(((adv != 0) & mask.bool()).sum()) / max(n, 1.0)
    return {"ess": float(ess), "zeroed": zeroed, "cosine": cos, "norm_ratio": ratio, "informative": informative,
            "tokens": int(n), "abs_log_ratio": float(gap.mean()) if gap.numel() else math.nan}


def shift_label(cfg: Config) -> str:
    """A short description of an arm's behaviour shift (what differs from on-policy float32 at the learner's
    temperature, ``objective.temperature``: by default 1)."""
    from ..recipes.backends import learner_temperature

    ro, tr = cfg.rollout, cfg.train
    parts = []
    if ro.temperature != learner_temperature(cfg):
        parts.append(f"T={ro.temperature:g}")
    if ro.top_p != 1.0:
        parts.append(f"top-p={ro.top_p:g}")
    if ro.engine != "transformers":
        parts.append(ro.engine)
    if ro.precision != "float32":
        parts.append(ro.precision)
    if ro.quantization:
        parts.append(ro.quantization)
    if ro.staleness:
        parts.append(f"lag {ro.staleness}")
    if ro.mode == "async":
        parts.append(f"async k≤{ro.max_staleness}")
    if ro.foreign_fraction > 0:
        parts.append(f"foreign {ro.foreign_fraction:g}")
    if tr.epochs * tr.minibatches > 1:
        parts.append(f"replay {tr.epochs}×{tr.minibatches}")
    return ", ".join(parts) or "none"


def _as_sync(cfg: Config) -> Config:
    """An async arm as the exact lag at its bound (module docstring), in one process."""
    if cfg.rollout.mode != "async":
        return cfg
    from ..pipeline.staleness import StalenessController

    k = StalenessController().k_max if cfg.rollout.max_staleness == "auto" else int(cfg.rollout.max_staleness)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"mode": "sync", "staleness": k}),
                                  "orchestrator": "local"})


class _Quiet:
    """Loop hooks for the pre-flight's warm-up rounds: no evaluation, log or checkpoint."""

    def before_train(self, round_, batch) -> None:
        pass

    def after_round(self, round_, metrics) -> None:
        pass


def _last_step_batch(learner, batch):
    """Run ``learner.train_on(batch)`` but its last optimizer step; return the batch that step would see."""
    last = learner.epochs * learner.minibatches - 1
    seen = []

    def stop_before(opt_step, mini_batch):
        seen.append(mini_batch)
        return opt_step == last

    learner.train_on(batch, stop_before=stop_before)
    return seen[-1]


def probe_arm(cfg: Config, arm: str = "", *, max_batches: int = 8, console=None) -> Probe:
    """Measure one arm (one seed: ``cfg.train.seed``) as described in the module docstring.

    Builds the task, the (cached) base and the arm's parts exactly as ``trustbatch train`` does; runs the
    warm-up rounds a lag needs; draws the measured batch (up to ``max_batches`` tries when dynamic sampling
    keeps no group) and probes the batch of its last optimizer step.

    Raises:
        UserError: the arm cannot be built here (e.g. an engine that is not installed), or no batch had an
            informative group.
    """
    from ..recipes.backends import learner_options, learner_temperature
    from ..recipes.build import build_parts, foreign_engine, preflight, prepare_run, scoring_check
    from ..trainer.loop import run_loop

    label = shift_label(cfg)
    cfg = _as_sync(cfg)
    if "async" in label:
        label += f" (as lag {cfg.rollout.staleness})"
    preflight(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)  # as trustbatch train seeds: the measured batch is the run's own
    task, policy, pool, _ = prepare_run(cfg, console)
    parts = None
    try:
        foreign = foreign_engine(cfg, task, policy) if cfg.rollout.foreign_fraction > 0 else None
        parts = build_parts(cfg, task, policy, pool, foreign=foreign,
                            check_round=scoring_check(cfg, task, console)).parts
        m = cfg.train.epochs * cfg.train.minibatches
        warm = -(-cfg.rollout.staleness // m)
        if warm:
            run_loop(parts, _Quiet(), start_round=0, rounds=warm)
        for _ in range(max_batches):
            batch = parts.source.next_batch(parts.learner.version)
            if batch is not None:
                break
        else:
            raise UserError(f"arm {arm!r}: {max_batches} batches in a row had no informative group; "
                            "turn off rollout.dynamic_sampling for the pre-flight or check the task")
        measured = _last_step_batch(parts.learner, batch)
        versions = measured.behaviour_versions()
        age = parts.learner.version - int(versions.min()) if versions.numel() else 0
        # an arm that trains the probed objective has it probed as it trains it; other arms get its defaults
        own = cfg.objective.name == PROBED
        res = probe_batch(policy.model, measured, p3o_options=learner_options(cfg) if own else {},
                          ess_scope=cfg.train.ess_scope if own else "batch",
                          micro_batch_size=cfg.train.micro_batch_size, temperature=learner_temperature(cfg))
    finally:
        if parts is not None:
            parts.source.close()
        pool.close()
    return Probe(arm=arm, seed=cfg.train.seed, shift=label, age=age, ess=res["ess"],
                 zeroed=res["zeroed"], cosine=res["cosine"], norm_ratio=res["norm_ratio"],
                 informative=res["informative"], tokens=res["tokens"],
                 response_length=float(batch.metrics.get("response_length", float("nan"))),
                 abs_log_ratio=res["abs_log_ratio"])


def summarize(probes: list[Probe]) -> list[dict]:
    """One row per arm: means over seeds; an arm is a control only if every seed is."""
    rows = []
    for arm in dict.fromkeys(p.arm for p in probes):
        ps = [p for p in probes if p.arm == arm]

        def mean(f):
            return _finite(sum(f(p) for p in ps) / len(ps))

        rows.append({"arm": arm, "shift": ps[0].shift, "seeds": [p.seed for p in ps], "age": ps[0].age,
                     "ess": mean(lambda p: p.ess),
                     **{f"zeroed@{e}": mean(lambda p, e=e: p.zeroed[e]) for e in EPSILONS},
                     **{f"cos@{e}": mean(lambda p, e=e: p.cosine[e]) for e in EPSILONS},
                     **{f"grad_norm_ratio@{e}": mean(lambda p, e=e: p.norm_ratio[e]) for e in EPSILONS},
                     "informative": mean(lambda p: p.informative),
                     "response_length": mean(lambda p: p.response_length),
                     "abs_log_ratio": mean(lambda p: p.abs_log_ratio),
                     "verdict": CONTROL_LABEL if all(p.control for p in ps) else TEST_LABEL})
    return rows


def run_preflight(experiment: str, out: Path, *, seeds: list[int] | None = None, console=None) -> dict:
    """Pre-flight every arm of ``experiment`` for ``seeds`` (default: the experiment's first seed).

    Writes ``OUT/<experiment>/preflight.json`` (atomically): ``{"experiment", "seeds", "epsilons",
    "control_rule", "arms": [one row per arm, means over seeds], "probes": [one per arm × seed],
    "skipped": {arm: reason}, "start", "end" (Unix seconds, base builds included: the report's cost table counts
    them), "commit"}``, and returns it.

    Raises:
        UserError: the experiment does not load, or no arm could be measured.
    """
    from ..records import atomic_write, git_commit
    from ..recipes.defaults import with_answer_budget
    from .experiment import load_experiment

    start = time.time()
    exp = load_experiment(experiment, seeds)
    seeds = list(seeds or exp.seeds[:1])
    probes, skipped = [], {}
    for seed in seeds:
        for arm in exp.arms:
            # the defaults that follow the data, as the arm's run gets them (lab.runner): a GSM8K arm at 512 tokens
            cfg = with_answer_budget(load_config(None, exp.overrides(arm, seed)))[0]
            if console is not None:
                console.print(f"[dim]pre-flight {exp.name}/{arm} seed {seed} ({shift_label(cfg)})…[/dim]")
            try:
                probes.append(probe_arm(cfg, arm, console=console))
            except UserError as e:
                skipped[arm] = str(e)
    if not probes:
        raise UserError(f"pre-flight of {exp.name!r}: no arm could be measured ({'; '.join(skipped.values())})")
    result = {"experiment": exp.name, "seeds": seeds, "epsilons": list(EPSILONS),
              "control_rule": CONTROL_RULE, "arms": summarize(probes), "probes": [p.as_json() for p in probes],
              "skipped": skipped, "start": start, "end": time.time(), "commit": git_commit()}
    atomic_write(Path(out) / exp.name / "preflight.json", json.dumps(result, indent=2, allow_nan=False))
    return result


def _finite(x: float) -> float | None:
    """NaN and inf are not JSON: null."""
    return x if math.isfinite(x) else None


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def preflight_table(result: dict):
    """A ``rich`` table of ``run_preflight``'s per-arm rows."""
    from rich import box
    from rich.table import Table

    t = Table(title=f"pre-flight: {result['experiment']} at the base policy (seeds {result['seeds']})",
              caption=f"|logρ|: mean |log π_θ − log π_b| per token; zero.2: share of tokens GRPO(ε = 0.2)'s clip "
                      f"zeroes; cos.2: ∇P3O vs ∇GRPO(0.2); age: optimizer steps since sampling. "
                      f"{result['control_rule']}", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
              pad_edge=False)
    for col in ("arm", "shift", "age", "ESS", "|logρ|", *[f"zero{str(e)[1:]}" for e in EPSILONS],
                *[f"cos{str(e)[1:]}" for e in EPSILONS], "verdict"):
        # numbers and names stay whole; the shift wraps, but never below a readable width
        t.add_column(col, justify="left" if col in ("arm", "shift", "verdict") else "right",
                     no_wrap=col != "shift", min_width=8 if col == "shift" else len(col))
    for r in result["arms"]:
        t.add_row(r["arm"], r["shift"], str(r["age"]), _fmt(r["ess"], ".4f"), _fmt(r.get("abs_log_ratio"), ".2e"),
                  *[_fmt(r[f"zeroed@{e}"], ".1%") for e in EPSILONS], *[_fmt(r[f"cos@{e}"], ".4f") for e in EPSILONS],
                  r["verdict"])
    for arm in result["skipped"]:
        t.add_row(arm, "", "", "", "", *[""] * (2 * len(EPSILONS)), "skipped")
    if result["skipped"]:
        t.caption += "".join(f"\nskipped {arm}: {why}" for arm, why in result["skipped"].items())
    return t
