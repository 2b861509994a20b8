"""Unbiased pass@k (Chen et al. 2021, arXiv 2107.03374, Eq. 1; docs/design/objectives.md §6)."""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct.

    pass@k = 1 − C(n−c, k)/C(n, k), computed in the stable product form
    1 − Π_{i=n−c+1}^{n} (1 − k/i); it is 1 when n − c < k.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod
