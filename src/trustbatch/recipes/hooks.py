"""The training loop's hooks around each round: the ratio histogram, held-out evaluation (with sample completions),
the metrics log, checkpoints, progress and the truncation warning."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..eval import evaluate_heldout
from ..eval.sampling import sample_row, with_extras
from ..parallel import World, full_model_state
from ..records import read_metrics
from ..rewards import round_state
from ..seeding import forked_rngs, row_seed
from ..trainer.checkpoint import save_checkpoint
from ..trainer.progress import Progress
from ..trainer.runlog import MetricsLog, log_ratio_histogram, log_step_records
from .build import optimizer_steps, scoring_check

EVAL_STREAM = 0xE7A1  # tags the evaluation's seeds apart from the rollouts' (same seed, same round)
TRUNCATION_WARNING = 0.2  # a round whose share of completions cut at rollout.max_new_tokens passes this is warned of


def truncation_advice(max_new_tokens: int, context: int | None, longest_prompt: int) -> str:
    """What to do about completions cut at ``max_new_tokens`` (all in tokens): raise the budget as far as the model's
    ``context`` holds it beside the ``longest_prompt`` (a longer one would drop prompts: ``fit_to_context``), or,
    where the context holds no more, say so."""
    if context is None:
        return "raise rollout.max_new_tokens"
    room = context - longest_prompt
    if room > max_new_tokens:
        return f"raise rollout.max_new_tokens (up to {room} keeps every prompt, longest {longest_prompt} tokens, in " \
               f"the model's context of {context})"
    return (f"the model's context of {context} tokens cannot hold more beside the longest prompt ({longest_prompt} "
            "tokens): use a model with a longer context (model.max_len for the default base) or shorter prompts")


def heldout_by_round(run_dir: Path) -> dict[int, float]:
    """``heldout_accuracy`` by round from ``metrics.jsonl`` (a resume truncates it to its checkpoint, so redone
    rounds count once), what ``checkpoint_keep_best`` ranks checkpoints by."""
    path = Path(run_dir) / "metrics.jsonl"
    recs = read_metrics(path) if path.is_file() else []
    return {int(r["step"]): float(r["heldout_accuracy"]) for r in recs if "heldout_accuracy" in r}


def batch_samples(batch, n: int, group_size: int, examples: list, decode) -> list[dict]:
    """``n`` sample completions of a round's batch (``TrainBatch`` with ``rewards`` and ``prompt_index``): the first
    completion of each of the batch's first ``n`` groups of ``group_size`` rows, then the second of each, ...;
    ``examples``: the task's training examples (prompt text, reference answer), ``decode``: token ids -> text.
    Each as ``eval.sampling.sample_row``: the behaviour log-prob sum is over the completion's tokens (float64); with
    the columns reward functions logged (``batch.extras``, TRL's ``log_extra``), as ``with_extras`` adds them."""
    C = batch.packed.response_mask.shape[1]
    rows = sorted(range(len(batch)), key=lambda r: (r % group_size, r // group_size))[:n]
    out = []
    for r in rows:
        mask = batch.packed.response_mask[r].cpu()
        example = examples[int(batch.prompt_index[r])]
        out.append(sample_row(example.prompt, decode(batch.packed.input_ids[r, -C:].cpu()[mask].tolist()),
                              float(batch.rewards[r]), example.reference,
                              float(batch.behavior_logprobs[r].cpu()[mask].double().sum())))
    return out if batch.extras is None else with_extras(out, [batch.extras[r] for r in rows])


class TrainHooks:
    """Around each round: the ratio histogram, held-out evaluation, the metrics log, checkpoints, progress."""

    def __init__(self, cfg: Config, run_dir: Path, built, policy, task, pool, log: MetricsLog, progress: Progress,
                 world: World, console=None, wall_before: float = 0.0, started: float | None = None):
        self.cfg, self.run_dir, self.built, self.policy, self.task, self.pool = cfg, run_dir, built, policy, task, pool
        self.log, self.progress, self.world, self.console = log, progress, world, console
        # the run's wall time: the earlier segments' (saved in the checkpoint resumed from), then this one's
        self.wall_before, self.started = wall_before, time.time() if started is None else started
        self._ratio_round: int | None = None
        self._truncation_warned = False

    def wall_s(self) -> float:
        """Seconds of wall time of the run so far, over all its segments: the earlier ones up to the checkpoint this
        one resumed from (the rounds a kill lost after it are redone, and counted once), then this one's."""
        return self.wall_before + time.time() - self.started

    def is_eval(self, round_: int) -> bool:
        return round_ % self.cfg.eval.every == 0 or round_ == self.cfg.train.steps

    def evaluate(self, round_: int) -> dict:
        """Held-out evaluation on a random stream of its own, seeded from (train.seed, round): how often
        it runs (``eval.every``, a resumable key) never moves the training's random streams."""
        c = self.cfg
        with forked_rngs():
            torch.manual_seed(row_seed(c.train.seed, round_, EVAL_STREAM))
            # the rollout rounds' failure-rate rule, stopping as soon as it is certain: a scorer that always
            # times out must not cost a whole evaluation before round 1 stops the run
            check = scoring_check(c, self.task, self.console, where=f"held-out evaluation at round {round_}")
            state = round_state(self.built.parts.learner.version, optimizer_steps(c), round_, c.rollout.prompts_per_step,
                                len(self.task.train))
            m = evaluate_heldout(self.policy, self.built.eval_engine, self.task.heldout, self.pool,
                                 samples_per_prompt=c.eval.samples_per_prompt, temperature=c.eval.temperature,
                                 max_new_tokens=c.rollout.max_new_tokens, check=check,
                                 max_failure_rate=c.reward.max_failure_rate, keep_samples=c.log.samples.heldout,
                                 state=state)
        self.log.log_samples(round_, "heldout", m.pop("samples", []))
        return m

    @property
    def sharded(self) -> bool:
        """FSDP2: the learner's forwards and gathers of its weights are collectives every rank must reach."""
        return self.built.parts.learner.sharded

    def refresh_eval(self) -> None:
        """Fill the evaluation engine's whole copy with the learner's weights, where it has one of its own
        (FSDP2 with a shifted rollout engine; every rank calls this, the shards are gathered)."""
        if self.built.eval_sync is not None:
            learner = self.built.parts.learner
            self.built.eval_sync.push(learner.model, learner.version)

    def save(self, round_: int) -> None:
        """Rank 0 writes the checkpoint; every rank calls this. Every rank's torch (CPU and CUDA) and Python random
        states are gathered (``rank_rng``, in rank order): a resume at the same world size continues each rank's own streams
        (rank 0's mini-batch permutation, ``Learner.train_on``; each rank's dropout). Under FSDP2 the whole weights and optimizer state are
        gathered to rank 0 too, so the checkpoint loads at any world size."""
        rank_rng = self.world.gather(self.world.random_states())
        if not (self.world.is_main or self.sharded):
            return
        parts = self.built.parts
        model_state = None
        if self.sharded:  # LoRA: the adapters alone, under the peft model's names (what save_adapter writes)
            adapter = self.policy.adapter
            model_state = (full_model_state(adapter, trainable_only=True) if adapter is not None
                           else full_model_state(self.policy.model))
        state = {"learner": parts.learner.state_dict(), "source": parts.source.state_dict(), "rank_rng": rank_rng,
                 "wall_s": self.wall_s()}
        if not self.world.is_main:
            return
        sync_state = parts.sync.state_dict()
        if sync_state:  # only a sync that serves other weights than the learner's (lagged) has any
            state["sync"] = sync_state
        save_checkpoint(self.run_dir, round_, self.policy, state, model_state=model_state, keep=self.cfg.checkpoint_keep,
                        best_of=heldout_by_round(self.run_dir) if self.cfg.checkpoint_keep_best else None)
        self.log.checkpointed(round_)

    def before_train(self, round_: int, batch) -> None:
        want = self.cfg.log.samples
        if self.world.is_main and want.train and round_ % want.every == 0 and batch.prompt_index is not None:
            self.log.log_samples(round_, "train", batch_samples(batch, want.train, self.cfg.rollout.group_size,
                                                                self.task.train, self.policy.decode))
        learner = self.built.parts.learner
        record = self.is_eval(round_) or round_ == 1
        if record and (self.world.is_main or self.sharded):  # a sharded forward needs every rank
            current = learner.logprobs(batch)
            if self.world.is_main:
                log_ratio_histogram(self.run_dir, round_, current.cpu() - batch.behavior_logprobs, batch.packed.response_mask)
        record = record and self.world.is_main
        # a replayed round (several optimizer steps per batch) also records each step's mini-batch
        self._ratio_round = round_ if record and self.cfg.train.epochs * self.cfg.train.minibatches > 1 else None
        # learner ranks in Ray actors have no such hook (None): their replayed rounds keep the one record
        hooks = learner.on_step_ratios
        if self._ratio_round is not None and hooks is not None and self._record_step_ratios not in hooks:
            hooks.append(self._record_step_ratios)

    def _record_step_ratios(self, opt_step: int, epoch: int, minibatch: int, log_ratio) -> None:
        """Rank 0's share of each optimizer step's mini-batch (other ranks' tokens are not gathered)."""
        if self._ratio_round is not None:
            log_ratio_histogram(self.run_dir, self._ratio_round, log_ratio, opt_step=opt_step, epoch=epoch,
                                minibatch=minibatch)

    def warn_truncation(self, round_: int, m: dict) -> None:
        """Once per run, one line when a round's share of completions cut at ``rollout.max_new_tokens`` (no EOS;
        the metric ``truncated_fraction``) passes ``TRUNCATION_WARNING``: their rewards score unfinished answers."""
        frac = m.get("truncated_fraction")
        if self._truncation_warned or self.console is None or frac is None or frac <= TRUNCATION_WARNING:
            return
        self._truncation_warned = True
        longest = max((len(self.policy.encode_prompt(e.prompt)) for e in self.task.train), default=0)
        context = getattr(self.policy.model.config, "max_position_embeddings", None)
        self.console.print(f"[yellow]warning: round {round_}: {frac:.0%} of the completions were cut at "
                           f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens} before their end (over "
                           f"{TRUNCATION_WARNING:.0%}); their rewards score unfinished answers: "
                           f"{truncation_advice(self.cfg.rollout.max_new_tokens, context, longest)} (warned once per "
                           "run)[/yellow]", highlight=False, soft_wrap=True)

    def after_round(self, round_: int, m: dict) -> None:
        skipped = "skipped_step" in m
        final = round_ == self.cfg.train.steps
        # A skipped round (no informative group) trained nothing, but its state is a valid resume point: a checkpoint
        # round saves, and the last round saves and evaluates, so the run's newest checkpoint and its summary are
        # the trained policy's, not one of checkpoint_every rounds before.
        evaluate = self.is_eval(round_) and (final or not skipped)
        save = round_ % self.cfg.checkpoint_every == 0 or final
        if evaluate:
            self.refresh_eval()
        if not self.world.is_main:
            if save:
                self.save(round_)  # gathers its random streams (and its shards under FSDP2); writes nothing
            return
        self.warn_truncation(round_, m)
        if skipped:
            if evaluate:
                m.update(self.evaluate(round_))
            self.log.log(round_, m)
            if save:
                self.save(round_)
            self.progress.advance(round_, "all groups uninformative: step skipped")
            return
        if evaluate:
            m.update(self.evaluate(round_))
        self.log.log(round_, m)
        steps = self.built.parts.learner.step_records
        if len(steps) > 1:
            log_step_records(self.run_dir, round_, steps)
        if save:
            self.save(round_)
        info = f"reward {m['reward_mean']:.3f}  ess {m.get('ess', float('nan')):.4f}"
        if "heldout_accuracy" in m:
            info += f"  held-out {m['heldout_accuracy']:.3f}"
        self.progress.advance(round_, info)
