"""How graders agree with each other and with people's labels on a run.

For each pair of graders that scored the same rollouts (the latest grade of each grader per rollout),
and for each grader against the labels: how many rollouts, the share on which they agree at a pass
threshold ("pass" is score >= threshold), Cohen's kappa, the Spearman correlation of the scores
(grader pairs), precision and recall of "pass" against the labels, and the rollouts they disagree on.
A statistic that is undefined on the data (Spearman with a constant grader, kappa when chance
agreement is already total, precision with no predicted pass) is None, never a made-up number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import combinations

from sqlalchemy.ext.asyncio import AsyncSession

from app.grading.repository import GradeRepository
from app.review import schemas as s
from app.review.label_repository import LabelRepository

MAX_DISAGREEMENTS = 500  # rollouts listed per pair (`disagreed` counts every one)


def percent_agreement(a: Sequence[bool], b: Sequence[bool]) -> float | None:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a) if a else None


def cohen_kappa(a: Sequence[bool], b: Sequence[bool]) -> float | None:
    """(observed - chance) / (1 - chance), chance from each side's share of passes; None when chance is 1."""
    if not a:
        return None
    n = len(a)
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / n
    pa, pb = sum(a) / n, sum(b) / n
    chance = pa * pb + (1 - pa) * (1 - pb)
    if math.isclose(chance, 1.0):
        return None
    return (observed - chance) / (1 - chance)


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Pearson's correlation of the ranks; None with fewer than 2 rollouts or a constant side."""
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return cov / math.sqrt(va * vb)


def precision_recall(predicted: Sequence[bool], truth: Sequence[bool]) -> tuple[float | None, float | None]:
    """Of "pass": precision (passes that people passed), recall (people's passes the grader passed)."""
    tp = sum(p and t for p, t in zip(predicted, truth, strict=True))
    predicted_pass, true_pass = sum(predicted), sum(truth)
    return (tp / predicted_pass if predicted_pass else None, tp / true_pass if true_pass else None)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def pair_agreement(
    a: str, b: str, scores: Mapping[str, Mapping[str, float]], threshold: float
) -> s.PairAgreement | None:
    both = sorted(set(scores[a]) & set(scores[b]))
    if not both:
        return None
    xa, xb = [scores[a][t] for t in both], [scores[b][t] for t in both]
    pa, pb = [x >= threshold for x in xa], [x >= threshold for x in xb]
    disagreements = [t for t, x, y in zip(both, pa, pb, strict=True) if x != y]
    return s.PairAgreement(
        a=a,
        b=b,
        n=len(both),
        agreement=_rounded(percent_agreement(pa, pb)),
        kappa=_rounded(cohen_kappa(pa, pb)),
        spearman=_rounded(spearman(xa, xb)),
        disagreed=len(disagreements),
        disagreements=disagreements[:MAX_DISAGREEMENTS],
    )


def label_agreement(
    grader: str, scores: Mapping[str, float], labels: Mapping[str, str], threshold: float
) -> s.LabelAgreement | None:
    both = sorted(set(scores) & set(labels))
    if not both:
        return None
    predicted = [scores[t] >= threshold for t in both]
    truth = [labels[t] == "pass" for t in both]
    precision, recall = precision_recall(predicted, truth)
    disagreements = [t for t, p, y in zip(both, predicted, truth, strict=True) if p != y]
    return s.LabelAgreement(
        grader=grader,
        n=len(both),
        agreement=_rounded(percent_agreement(predicted, truth)),
        kappa=_rounded(cohen_kappa(predicted, truth)),
        precision=_rounded(precision),
        recall=_rounded(recall),
        disagreed=len(disagreements),
        disagreements=disagreements[:MAX_DISAGREEMENTS],
    )


def agreement_of(
    run: str, threshold: float, scores: Mapping[str, Mapping[str, float]], labels: Mapping[str, str]
) -> s.Agreement:
    graders = sorted(scores)
    pairs = [pair_agreement(a, b, scores, threshold) for a, b in combinations(graders, 2)]
    against = [label_agreement(g, scores[g], labels, threshold) for g in graders]
    return s.Agreement(
        run=run,
        threshold=threshold,
        pairs=[p for p in pairs if p is not None],
        labels=[g for g in against if g is not None],
    )


class GraderAgreement:
    """A run's agreement figures, from the latest grade of each grader per rollout and the labels."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def scores(self, run: str) -> dict[str, dict[str, float]]:
        return await GradeRepository(self.session).latest_scores(run)

    async def figures(
        self, run: str, threshold: float, scores: Mapping[str, Mapping[str, float]] | None = None
    ) -> s.Agreement:
        if scores is None:
            scores = await self.scores(run)
        labels = await LabelRepository(self.session).of_run(run)
        return agreement_of(run, threshold, scores, labels)
