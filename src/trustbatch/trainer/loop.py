"""The synchronous RL loop: sample → score → group advantages → learner steps → sync weights → evaluate.

Read it top to bottom; each block is one stage of the data flow in docs/architecture.md.
"""

from __future__ import annotations

import copy
import json
import random
import time
from datetime import datetime
from pathlib import Path

import torch

from .. import objectives, rewards
from ..advantages import group_advantages, overlong_penalty
from ..config import Config, dump_config, load_config
from ..data import load_task
from ..data.benchmarks import load_file_task
from ..errors import UserError
from ..eval import evaluate_heldout
from ..policy import load_policy
from ..policy.base import default_base
from ..policy.forward import pack
from ..rollout import TransformersEngine
from ..rollout.shifts import WeightHistory
from .checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from .learner import Learner, TrainBatch
from .runlog import MetricsLog, atomic_write, plot_run, read_metrics


def build_batch(rollouts, adv: torch.Tensor, pad_id: int) -> TrainBatch:
    """Pack rollouts into learner tensors; behaviour log-probs are right-aligned like the completions."""
    packed = pack([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    C = packed.response_mask.shape[1]
    blp = torch.zeros(len(rollouts), C, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        blp[i, C - len(r.behavior_logprobs):] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    return TrainBatch(packed=packed, behavior_logprobs=blp, advantages=adv.float())


def _check_objective_options(cfg: Config) -> None:
    """Call the objective once on a 1×2 batch so that a bad option fails before any work is done."""
    fn = objectives.get(cfg.objective.name)
    lp = torch.zeros(1, 2, requires_grad=True)
    kw = {"proximal_logprobs": torch.zeros(1, 2)} if cfg.objective.name in objectives.NEEDS_PROXIMAL else {}
    try:
        fn(lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), **kw, **cfg.objective.options)
    except (TypeError, ValueError) as e:
        raise UserError(f"invalid objective.options for {cfg.objective.name!r}: {e}") from None


def configured_task(cfg: Config):
    """The task split that ``cfg.data`` (files) or else ``cfg.task`` (reasoning-gym) describes."""
    if cfg.data.train:
        return load_file_task(cfg.data)
    return load_task(cfg.task.name, train_size=cfg.task.train_size, heldout_size=cfg.task.heldout_size,
                     seed=cfg.task.seed, params=cfg.task.params)


def task_key(cfg: Config) -> dict:
    """What determines the task's prompts, for the default base's cache key."""
    return cfg.data.model_dump(mode="json") if cfg.data.train else cfg.task.model_dump(mode="json")


def prepare_run(cfg: Config, console=None):
    """Task, policy, reward pool: everything a run, SFT or eval needs from the config."""
    task = configured_task(cfg)
    pool = rewards.RewardPool(cfg.reward.name or task.reward, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
    if cfg.model.path:
        policy, source = load_policy(cfg.model.path), cfg.model.path
    else:
        if console:
            console.print("[dim]building or loading the cached default base model (SFT warm-up)…[/dim]")
        policy, path, built = default_base(task, task_key(cfg), cfg.model.model_dump(mode="json"))
        source = f"{path} ({'built now' if built else 'cached'})"
    return task, policy, pool, source


def train(cfg: Config | None = None, resume: str | None = None, overrides: list[str] | None = None, console=None) -> dict:
    """Run RL post-training. Returns the summary dict (also written to ``summary.json``).

    ``resume`` continues the run in that directory from its last checkpoint; ``overrides`` then
    apply on top of its saved config (e.g. ``train.steps=300`` to extend it).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    # ---- configuration and run directory ---------------------------------------------------
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"cannot resume {str(run_dir)!r}: it has no config.yaml (not a trustbatch run directory)")
        import yaml

        cfg = load_config(None, overrides, base=yaml.safe_load((run_dir / "config.yaml").read_text()))
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise UserError(f"cannot resume {str(run_dir)!r}: it has no checkpoint yet")
    else:
        cfg = cfg or load_config()
        run_dir = Path(cfg.run_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}-{cfg.objective.name}")
        if (run_dir / "metrics.jsonl").exists():
            raise UserError(f"run directory {str(run_dir)!r} already holds a run; use --resume {run_dir} or another run_dir")
        ckpt = None
    _check_objective_options(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", dump_config(cfg.model_copy(update={"run_dir": str(run_dir)})))
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    # ---- task, policy, reward pool, engine, learner ---------------------------------------------
    t_start = time.time()
    task, policy, pool, source = prepare_run(cfg, console)
    ro_cfg, tr = cfg.rollout, cfg.train
    foreign = foreign_engine(cfg, task, policy) if ro_cfg.foreign_fraction > 0 else None  # before any checkpoint
    start_step = 0
    if ckpt is not None:
        policy = load_policy(ckpt)
    # The behaviour policy: the learner's own module (sync, on-policy), or a shifted copy (the lab).
    shifted = ro_cfg.precision != "float32" or ro_cfg.staleness > 0
    engine = TransformersEngine(policy.model, policy.eos_id, policy.pad_id, precision=ro_cfg.precision, share=not shifted)
    history = WeightHistory(ro_cfg.staleness + tr.epochs * tr.minibatches) if ro_cfg.staleness else None
    # held-out evaluation always measures the learner's own float32 policy
    eval_engine = TransformersEngine(policy.model, policy.eos_id, policy.pad_id) if shifted else engine
    learner = Learner(policy.model, cfg.objective.name, cfg.objective.options, lr=cfg.train.lr,
                      weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip,
                      micro_batch_size=cfg.train.micro_batch_size, ess_scope=cfg.train.ess_scope,
                      warmup_steps=cfg.train.warmup_steps)
    log = MetricsLog(run_dir)
    if ckpt is not None:
        state = load_trainer_state(ckpt)
        learner.optimizer.load_state_dict(state["optimizer"])
        learner.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        start_step = state["step"]
        engine.version = state.get("policy_version", start_step)
        log.truncate_after(start_step)
        console.print(f"resuming {run_dir} from {ckpt.name}")
    rng = random.Random(cfg.train.seed * 1_000_003 + start_step)
    train_prompts = [policy.encode_prompt(e.prompt) for e in task.train]
    if not train_prompts:
        raise UserError("the task produced no training prompts; raise task.train_size")

    def evaluate() -> dict:
        return evaluate_heldout(policy, eval_engine, task.heldout, pool, samples_per_prompt=cfg.eval.samples_per_prompt,
                                temperature=cfg.eval.temperature, max_new_tokens=cfg.rollout.max_new_tokens)

    console.print(f"[bold]trustbatch train[/bold] objective={cfg.objective.name} task={task.name} "
                  f"({len(task.train)} train / {len(task.heldout)} held-out prompts) model={source}")
    console.print(f"run directory: {run_dir}")
    if start_step == 0:
        base_eval = evaluate()
        log.log(0, base_eval)
        console.print(f"base policy: held-out accuracy {base_eval['heldout_accuracy']:.3f} "
                      f"(greedy {base_eval['heldout_greedy_accuracy']:.3f})")

    # ---- the loop ----------------------------------------------------------------------------
    opt_steps = engine.version  # the policy version: optimizer steps taken so far
    if history is not None:
        history.record(opt_steps, policy.model)
    progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console, transient=False)
    last: dict = {}
    with progress:
        bar = progress.add_task("rl", total=tr.steps, completed=start_step, info="")
        for step in range(start_step + 1, tr.steps + 1):
            t0 = time.time()
            # 1–2. rollouts from the behaviour policy, scored by the task's scorer
            rollouts, rew, sampled, reward_errors, reward_timeouts, dropped = [], [], [], 0, 0, 0
            for _round in range(ro_cfg.max_sampling_rounds if ro_cfg.dynamic_sampling else 1):
                need = ro_cfg.prompts_per_step - len(rollouts) // ro_cfg.group_size
                idx = [rng.randrange(len(task.train)) for _ in range(need)]
                new = sample_groups(engine, foreign, [train_prompts[i] for i in idx], ro_cfg)
                scored = pool.score([policy.decode(x.completion_ids) for x in new],
                                    [task.train[idx[x.prompt_index]].reference for x in new])
                r = scored.rewards
                reward_errors += scored.errors
                reward_timeouts += scored.timeouts
                sampled += r
                for j in range(need):  # one group per prompt, G consecutive rollouts
                    g = slice(j * ro_cfg.group_size, (j + 1) * ro_cfg.group_size)
                    if ro_cfg.dynamic_sampling and len(set(r[g])) < 2:
                        dropped += 1  # all-equal rewards: zero advantage, no signal (DAPO)
                        continue
                    rollouts += new[g]
                    rew += r[g]
                if len(rollouts) // ro_cfg.group_size >= ro_cfg.prompts_per_step:
                    break
            t_gen = time.time() - t0
            if not rollouts:
                log.log(step, {"reward_mean": sum(sampled) / len(sampled), "groups_dropped": float(dropped),
                               "skipped_step": 1.0})
                progress.update(bar, advance=1, info="all groups uninformative: step skipped")
                continue
            rew_t = torch.tensor(rew)
            if ro_cfg.overlong_cache:
                lengths = torch.tensor([len(x.completion_ids) for x in rollouts])
                rew_t = rew_t + overlong_penalty(lengths, ro_cfg.max_new_tokens, ro_cfg.overlong_cache)
            # 3. group advantages (group = position of the group in this batch)
            groups = torch.arange(len(rollouts)) // ro_cfg.group_size
            adv = group_advantages(rew_t, groups, cfg.objective.advantage, std=cfg.objective.std)
            batch = build_batch(rollouts, adv, policy.pad_id)
            behaviour_version = engine.version
            is_eval = step % cfg.eval.every == 0 or step == tr.steps or step == start_step + 1
            if cfg.objective.name in objectives.NEEDS_PROXIMAL or is_eval:
                current = learner.logprobs(batch)  # π_θ before this batch's updates (π_prox for two-anchor)
                if cfg.objective.name in objectives.NEEDS_PROXIMAL:
                    batch.proximal_logprobs = current
                if is_eval:
                    log_ratio_histogram(run_dir, step, current - batch.behavior_logprobs, batch.packed.response_mask)
            # 4. learner: epochs × minibatches optimizer steps (later ones are off-policy: replay)
            step_metrics: list[dict] = []
            for _epoch in range(tr.epochs):
                perm = torch.randperm(len(batch))
                for mb in perm.chunk(tr.minibatches):
                    step_metrics.append(learner.step(batch.select(mb)))
                    opt_steps += 1
                    if history is not None:
                        history.record(opt_steps, policy.model)
            # 5. the behaviour policy catches up with the learner (or with the learner of k steps ago)
            if history is not None:
                version, state = history.at_or_before(opt_steps - ro_cfg.staleness)
                engine.load_state(state, version)
            else:
                engine.sync_weights(policy.model, opt_steps)
            dt = time.time() - t0
            lengths = [len(r.completion_ids) for r in rollouts]
            n_tok = sum(lengths)
            m = {k: sum(s[k] for s in step_metrics) / len(step_metrics) for k in step_metrics[0]}
            m.update(
                reward_mean=sum(sampled) / len(sampled),
                reward_std=float(torch.tensor(sampled).std()),
                groups_dropped=float(dropped),
                reward_errors=float(reward_errors),
                reward_timeouts=float(reward_timeouts),
                response_length=n_tok / len(rollouts),
                truncated_fraction=sum(r.truncated for r in rollouts) / len(rollouts),
                tokens_per_s=n_tok / dt,
                rollout_s=t_gen,
                step_s=dt,
                policy_version=float(opt_steps),
                behaviour_version=float(behaviour_version),
                staleness=float(opt_steps - len(step_metrics) - behaviour_version),
                foreign_fraction=float(round(ro_cfg.group_size * ro_cfg.foreign_fraction) / ro_cfg.group_size),
                optimizer_steps=float(len(step_metrics)),
            )
            # 6. held-out evaluation every N rounds, and at the end
            if step % cfg.eval.every == 0 or step == tr.steps:
                m.update(evaluate())
            log.log(step, m)
            last = m
            if step % cfg.checkpoint_every == 0 or step == tr.steps:
                save_checkpoint(run_dir, step, policy, learner.optimizer,
                                {"policy_version": opt_steps, "scheduler": learner.scheduler.state_dict()})
            info = f"reward {m['reward_mean']:.3f}  ess {m.get('ess', float('nan')):.4f}"
            if "heldout_accuracy" in m:
                info += f"  held-out {m['heldout_accuracy']:.3f}"
            progress.update(bar, advance=1, info=info)
    log.close()
    pool.close()

    # ---- plot and summary ------------------------------------------------------------------------
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_run(records, run_dir / "plot.png", title=f"{cfg.objective.name} on {task.name}")
    evals = [r for r in records if "heldout_accuracy" in r]
    summary = {
        "objective": cfg.objective.name,
        "task": task.name,
        "steps": tr.steps,
        "heldout_prompts": len(task.heldout),
        "base_heldout_accuracy": evals[0]["heldout_accuracy"] if evals else None,
        "final_heldout_accuracy": evals[-1]["heldout_accuracy"] if evals else None,
        "base_heldout_greedy_accuracy": evals[0].get("heldout_greedy_accuracy") if evals else None,
        "final_heldout_greedy_accuracy": evals[-1].get("heldout_greedy_accuracy") if evals else None,
        "final_reward_mean": last.get("reward_mean"),
        "final_ess": last.get("ess"),
        "wall_s": time.time() - t_start,
        "run_dir": str(run_dir),
    }
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2))
    console.print(
        f"[bold]done[/bold] in {summary['wall_s']:.0f}s: held-out accuracy "
        f"{_fmt(summary['base_heldout_accuracy'])} → {_fmt(summary['final_heldout_accuracy'])} "
        f"(greedy {_fmt(summary['base_heldout_greedy_accuracy'])} → {_fmt(summary['final_heldout_greedy_accuracy'])}); "
        f"plot {run_dir / 'plot.png'}"
    )
    return summary


def sample_groups(engine, foreign, prompts: list[list[int]], ro_cfg) -> list:
    """G rollouts per prompt, grouped; with a foreign engine, the last round(G·f) of each group are its samples."""
    G = ro_cfg.group_size
    m = round(G * ro_cfg.foreign_fraction) if foreign is not None else 0
    kw = dict(temperature=ro_cfg.temperature, top_p=ro_cfg.top_p, max_new_tokens=ro_cfg.max_new_tokens)
    own = engine.generate(prompts, G - m, **kw)
    if m == 0:
        return own
    alien = foreign.generate(prompts, m, **kw)
    out = []
    for i in range(len(prompts)):
        out += own[i * (G - m):(i + 1) * (G - m)] + alien[i * m:(i + 1) * m]
    return out


def foreign_engine(cfg: Config, task, policy) -> TransformersEngine:
    """An engine on another model that shares the policy's tokenizer (``rollout.foreign_model``); never synced.

    Raises:
        UserError: the foreign model's tokenizer differs from the policy's.
    """
    spec = cfg.rollout.foreign_model
    if spec == "initial":
        other = copy.deepcopy(policy.model)  # the frozen starting checkpoint
    else:
        if isinstance(spec, dict):
            foreign_policy, _, _ = default_base(task, task_key(cfg), {**cfg.model.model_dump(mode="json"), **spec})
        else:
            foreign_policy = load_policy(spec)
        if foreign_policy.tokenizer.get_vocab() != policy.tokenizer.get_vocab():
            raise UserError(f"rollout.foreign_model {spec!r} has another tokenizer; foreign data must share the policy's")
        other = foreign_policy.model
    return TransformersEngine(other, policy.eos_id, policy.pad_id)


def log_ratio_histogram(run_dir: Path, step: int, log_ratio: torch.Tensor, mask: torch.Tensor) -> None:
    """Append the histogram of token log-ratios log π_θ/μ (before the step's update) to ``ratios.jsonl``."""
    edges = torch.linspace(-2.0, 2.0, 81)
    x = log_ratio[mask].detach().float().clamp(-2.0, 2.0)
    counts = torch.histc(x, bins=80, min=-2.0, max=2.0)
    rec = {"step": step, "edges": [round(e, 4) for e in edges.tolist()], "counts": [int(c) for c in counts.tolist()]}
    with open(run_dir / "ratios.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
