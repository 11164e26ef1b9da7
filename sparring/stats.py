"""The statistics of an eval report: pass@k and pass^k, and standard errors that respect the items.

Rollouts of one item are not independent (the same task, often the same mistake), so a mean's standard
error is clustered by item (the sandwich estimator with the small-sample factor G/(G-1)): with one
rollout per item it is the usual s/sqrt(n); with several it is wider, as it should be.

pass@k is the chance that at least one of k rollouts of an item passes, pass^k that all k do (τ-bench's
reliability measure); both use the unbiased estimators over an item's n graded rollouts of which c
passed (Chen et al. 2021: 1 - C(n-c, k)/C(n, k); and C(c, k)/C(n, k)), averaged over the items with
at least k graded rollouts, with the standard error of that average over items.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k draws passes) from n rollouts of which c passed."""
    _check(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(all of k draws pass) (pass^k) from n rollouts of which c passed."""
    _check(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def _check(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")


def clustered_stderr(clusters: Sequence[Sequence[float]]) -> float | None:
    """The standard error of the mean of all values, clustered by the groups given (items); None with
    fewer than two groups (one item says nothing about the spread between items)."""
    groups = [list(group) for group in clusters if group]
    count = sum(len(group) for group in groups)
    if len(groups) < 2:
        return None
    mean = sum(sum(group) for group in groups) / count
    spread = sum(sum(v - mean for v in group) ** 2 for group in groups)
    return math.sqrt(len(groups) / (len(groups) - 1) * spread) / count


def mean_stderr(values: Sequence[float]) -> float | None:
    """The standard error of a mean of independent values (sample standard deviation / sqrt(n))."""
    return clustered_stderr([[value] for value in values])


def pass_table(scores_by_item: Mapping[str, Sequence[float]], threshold: float) -> list[dict[str, Any]]:
    """pass@k and pass^k for k = 1 .. the most graded rollouts of an item: a score passes when it is
    at least `threshold`. Each k is over the items with at least k graded rollouts (`items`)."""
    counts = [(len(s), sum(1 for v in s if v >= threshold)) for s in scores_by_item.values() if s]
    rows = []
    for k in range(1, max((n for n, _ in counts), default=0) + 1):
        at = [pass_at_k(n, c, k) for n, c in counts if n >= k]
        hat = [pass_hat_k(n, c, k) for n, c in counts if n >= k]
        rows.append(
            {
                "k": k,
                "items": len(at),
                "pass_at_k": sum(at) / len(at),
                "pass_at_k_stderr": mean_stderr(at),
                "pass_hat_k": sum(hat) / len(hat),
                "pass_hat_k_stderr": mean_stderr(hat),
            }
        )
    return rows
