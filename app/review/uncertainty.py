"""How sure a comparison of two runs is: standard errors of mean rewards and a bootstrap interval.

A run's rollouts of one item are not independent draws (the same prompt, the same difficulty), so the
95% interval of the change of mean reward resamples **items**, not rollouts: each run's items are drawn
with replacement (with all their rollouts), the run's mean is recomputed over the rollouts drawn, and
the interval is the 2.5th and 97.5th percentiles of the difference b − a. The seed is fixed, so a page
shows the same interval every time it is drawn.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

RESAMPLES = 1000
WORK_CAP = 2_000_000  # items drawn in all: fewer resamples for runs with very many items
MIN_RESAMPLES = 200
SEED = 20261205


@dataclass(frozen=True)
class ItemScores:
    """One item of a run: how many scored rollouts it has and the sum of their scores."""

    rollouts: int
    total: float


def standard_error(std: float | None, n: int) -> float | None:
    """The standard error of a mean of `n` values with population std `std` (None for n < 2)."""
    if std is None or n < 2:
        return None
    return std * math.sqrt(n / (n - 1)) / math.sqrt(n)


def combined_error(a: float | None, b: float | None) -> float | None:
    """The standard error of b − a for independent runs."""
    return None if a is None or b is None else math.hypot(a, b)


def resamples_for(items_a: int, items_b: int) -> int:
    """The bootstrap's resamples: RESAMPLES, fewer (at least MIN_RESAMPLES) past WORK_CAP items drawn."""
    drawn = max(items_a + items_b, 1)
    return max(MIN_RESAMPLES, min(RESAMPLES, WORK_CAP // drawn))


def _resampled_mean(items: Sequence[ItemScores], rng: random.Random) -> float | None:
    picked = rng.choices(items, k=len(items))
    rollouts = sum(item.rollouts for item in picked)
    return sum(item.total for item in picked) / rollouts if rollouts else None


def bootstrap_difference(
    items_a: Sequence[ItemScores], items_b: Sequence[ItemScores], *, resamples: int | None = None
) -> tuple[float, float] | None:
    """The 95% interval of (mean of b − mean of a), resampling items; None with fewer than 2 items a side."""
    a = [item for item in items_a if item.rollouts > 0]
    b = [item for item in items_b if item.rollouts > 0]
    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(SEED)
    differences = []
    for _ in range(resamples or resamples_for(len(a), len(b))):
        mean_a, mean_b = _resampled_mean(a, rng), _resampled_mean(b, rng)
        if mean_a is not None and mean_b is not None:
            differences.append(mean_b - mean_a)
    differences.sort()
    last = len(differences) - 1
    return differences[round(0.025 * last)], differences[round(0.975 * last)]
