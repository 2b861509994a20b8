"""Reward scorers: ``score(completion: str, reference: str) -> float`` in [0, 1].

Names (``get``):
- ``math``: final answer (last ``\\boxed{}``, else math-verify's reading of the completion) verified by math-verify;
- ``gsm8k``: the number after ``####``;
- ``countdown``: an expression over the given numbers (each at most once) that equals the target;
- ``countdown_exact``: the same with every number exactly once (TinyZero's and d1's rule);
- ``rg:TASK``: a reasoning-gym task's own ``score_answer``;
- ``rg-final:TASK``: worked steps ending in ``answer X``: ``score_answer`` of X (``data.tasks.chain_sum_steps``);
- ``module:function``: a user function with the scorer signature, or TRL's batch form
  ``f(prompts, completions, **columns) -> list`` (``scorers.BatchForm``: it has a ``completions`` parameter),
  called once per group of one prompt's completions, with what else TRL passes it (``trl_kwargs``: ``trainer_state``,
  ``log_metric``, ``log_extra``).

``functions.WeightedRewards`` combines several with weights (``reward.functions``), each as it returns, outside
[0, 1] too (TRL's sum of ``reward_funcs``), where one scorer's reward outside [0, 1] is clamped and counted.

``RewardPool`` runs any of them in worker processes with a time limit; ``score_local`` runs one in
this process. Neither raises on a scorer's error: the reward is 0 and the error is counted, and
``check_scoring`` turns a round's counts into a warning, or a UserError past ``reward.max_failure_rate``.
"""

from . import functions
from .functions import Terms, WeightedRewards, make_reward
from .pool import RewardPool
from .scorers import (BUILTIN, COMPLETION_IDS_KEY, GROUP_KEY, FinalAnswerScorer, ReasoningGymScorer, ScoreResult, Scorer, check_scoring,
                      get, merge_logged, one_line, score_all, score_local, score_one)
from .spec import RewardSpec
from .trl_kwargs import STATE_KEY, TrainerState, round_state

__all__ = ["BUILTIN", "COMPLETION_IDS_KEY", "GROUP_KEY", "FinalAnswerScorer", "ReasoningGymScorer", "RewardPool", "RewardSpec", "ScoreResult", "Scorer",
           "Terms", "WeightedRewards", "check_scoring", "functions", "get", "make_reward", "score_all", "score_local",
           "score_one", "STATE_KEY", "TrainerState", "merge_logged", "round_state"]
