"""People's labels of rollouts: set and remove one, and the labelling queue of a run.

The queue is stratified so that a few dozen labels speak for the whole run: the run's unlabelled
rollouts are grouped by score band (of their latest grade) and, within a band, by item; the queue
takes one rollout of each band in turn, and within a band one of each item in turn. The order inside
a group is a hash of the trace id: fixed for a run (the same queue on every reload), unrelated to time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime
from itertools import zip_longest

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.text import storable
from app.errors import NotFound
from app.grading.repository import GradeRepository
from app.review import schemas as s
from app.review.label_repository import LabelRepository, QueueCandidate
from app.rollouts.repository import RolloutRepository

BANDS = 4  # score bands of the queue: [0, .25), [.25, .5), [.5, .75), [.75, 1]
QUEUE_CAP = 20000  # unlabelled rollouts of a run the queue draws from


def band_of(score: float | None, bands: int = BANDS) -> str:
    """The score band a rollout falls in ("ungraded" without a score); scores outside [0, 1] are clamped."""
    if score is None:
        return "ungraded"
    index = min(max(int(score * bands), 0), bands - 1)
    return f"{index / bands:g}-{(index + 1) / bands:g}"


def _spread(groups: Sequence[Sequence[QueueCandidate]]) -> list[QueueCandidate]:
    """One of each group in turn, until every group is used up."""
    return [c for round_ in zip_longest(*groups) for c in round_ if c is not None]


def _shuffled(candidates: list[QueueCandidate]) -> list[QueueCandidate]:
    return sorted(candidates, key=lambda c: hashlib.sha256(c.trace_id.encode()).digest())


def stratified(candidates: Sequence[QueueCandidate], limit: int, bands: int = BANDS) -> list[QueueCandidate]:
    """The first `limit` rollouts of the stratified queue (see the module's docstring)."""
    by_band: dict[str, dict[str, list[QueueCandidate]]] = {}
    for candidate in candidates:
        items = by_band.setdefault(band_of(candidate.score, bands), {})
        items.setdefault(candidate.item_key or "", []).append(candidate)
    band_queues = []
    for band in sorted(by_band):
        items = by_band[band]
        item_order = sorted(items, key=lambda key: hashlib.sha256(key.encode()).digest())
        band_queues.append(_spread([_shuffled(items[key]) for key in item_order]))
    return _spread(band_queues)[:limit]


class RolloutLabels:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session
        self.repo = LabelRepository(session)

    async def _require_rollout(self, trace_id: str) -> None:
        if await RolloutRepository(self.session).get(trace_id) is None and not await GradeRepository(
            self.session
        ).for_trace(trace_id):
            raise NotFound(f"no rollout with trace_id {trace_id!r}")

    async def put(self, trace_id: str, label: s.LabelIn, *, by: str) -> s.LabelOut:
        await self._require_rollout(trace_id)
        # A NUL as U+FFFD, as everywhere the server stores text (Postgres text cannot hold it).
        note = storable(label.note.strip()) if label.note and label.note.strip() else None
        await self.repo.put(trace_id, label=label.label, note=note, by=by, at=datetime.now(UTC))
        stored = await self.repo.get(trace_id)
        return s.LabelOut.model_validate(stored, from_attributes=True)

    async def get(self, trace_id: str) -> s.LabelOut | None:
        stored = await self.repo.get(trace_id)
        return s.LabelOut.model_validate(stored, from_attributes=True) if stored is not None else None

    async def delete(self, trace_id: str) -> None:
        if not await self.repo.delete(trace_id):
            raise NotFound(f"rollout {trace_id!r} has no label")

    async def queue(self, run: str, grader: str | None, *, limit: int) -> s.LabelQueue:
        candidates = await self.repo.unlabelled(run, grader, cap=QUEUE_CAP)
        chosen = stratified(candidates, limit)
        # The candidates stop at the cap: past it, the run's unlabelled rollouts are counted.
        unlabelled = len(candidates) if len(candidates) < QUEUE_CAP else await self.repo.unlabelled_count(run)
        return s.LabelQueue(
            run=run,
            grader=grader,
            unlabelled=unlabelled,
            labelled=len(await self.repo.of_run(run)),
            rollouts=[
                s.QueueEntry(trace_id=c.trace_id, item_key=c.item_key, score=c.score, band=band_of(c.score))
                for c in chosen
            ],
        )

    async def next_in_queue(self, run: str, grader: str | None, *, after: str | None = None) -> str | None:
        """The rollout after `after` in the run's queue, past its last the first again (skipping walks
        the whole queue); the first when `after` is not in it (just labelled). None: nothing left."""
        candidates = await self.repo.unlabelled(run, grader, cap=QUEUE_CAP)
        order = [c.trace_id for c in stratified(candidates, len(candidates))]
        if after in order:
            at = order.index(after)
            order = order[at + 1 :] + order[:at]
        return order[0] if order else None
