"""Group advantage estimators and reward shaping (docs/design/objectives.md §3.3, §4).

Rewards arrive as a flat ``[N]`` tensor with ``group_ids`` ``[N]`` (G completions per prompt share
an id). Each estimator returns ``[N]`` advantages, one scalar per completion; the learner copies it
to every response token.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("zscore", "mean", "rloo")


def _group_index(group_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}; expected [{n}] like rewards")
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, len(uniq)


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "zscore", *, std: str = "population",
    eps: float = 1e-6, valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``[N]`` (float32) from rewards ``[N]`` grouped by ``group_ids`` ``[N]``.

    - "zscore" (GRPO, arXiv 2402.03300 Eq. 3): (r − μ_g)/(σ_g + eps); ``std`` is "population" (the
      P3O paper's Eq. 3) or "sample" (n − 1, the reference code; a group of one keeps A = r − μ = 0).
    - "mean" (Dr.GRPO, arXiv 2503.20783): r − μ_g.
    - "rloo" (Kool et al. 2019; arXiv 2402.14740): r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − μ_g);
      a group of one gets 0.

    Example, rewards (1, 0, 0, 0): population z (1.732, −0.577, ...), sample z (1.5, −0.5, ...),
    mean (0.75, −0.25, ...), rloo (1, −1/3, ...).

    ``valid`` (bool ``[N]``, default all): rows left out are in no group's statistics and get advantage 0: a
    completion every reward function said does not apply to (TRL's NaN reward; TRL 1.16's GRPOTrainer masks it so,
    where a 0 would bias its group's baseline and give it an advantage of its own).

    Raises:
        ValueError: unknown estimator or std, mismatched shapes, non-finite rewards.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    if std not in ("population", "sample"):
        raise ValueError(f"std={std!r} must be 'population' or 'sample'")
    r = rewards.detach().double().reshape(-1)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain non-finite values; scorers must return finite floats")
    inv, g = _group_index(group_ids.reshape(-1), r.numel())
    w = torch.ones_like(r) if valid is None else valid.reshape(-1).to(torch.float64)
    size = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, w)
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, r * w) / size.clamp_min(1)
    centred = (r - mean[inv]) * w
    if estimator == "mean":
        return centred.float()
    if estimator == "rloo":
        s = size[inv]
        return torch.where(s > 1, centred * s / (s - 1).clamp_min(1), 0.0).float()
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, centred * centred)
    denom = size.clamp_min(1) if std == "population" else (size - 1).clamp_min(1)
    sigma = (sq / denom).sqrt()
    return (centred / (sigma[inv] + eps)).float()


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[N]``: True where the completion's group has at least two distinct rewards.

    DAPO dynamic sampling (arXiv 2503.14476) keeps only such groups, because an all-equal group
    has zero advantage and only dilutes the token mean; the caller samples more prompts to refill.
    """
    r = rewards.detach().double().reshape(-1)
    inv, g = _group_index(group_ids.reshape(-1), r.numel())
    lo = torch.full((g,), float("inf"), dtype=torch.float64).scatter_reduce(0, inv, r, "amin")
    hi = torch.full((g,), float("-inf"), dtype=torch.float64).scatter_reduce(0, inv, r, "amax")
    return (hi > lo)[inv]


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO overlong reward shaping (arXiv 2503.14476), added to the task reward. ``[N]`` float32.

    0 if |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|)/L_cache inside the cache zone; −1 beyond L_max.
    Raises ValueError unless 0 < cache_len ≤ max_len.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong shaping needs 0 < cache_len <= max_len, got {cache_len}, {max_len}")
    y = lengths.double()
    start = max_len - cache_len
    pen = torch.where(y <= start, 0.0, (start - y) / cache_len)
    return torch.where(y > max_len, -1.0, pen).float()
