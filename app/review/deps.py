"""The review's route dependencies: its two services on the request's database session, the pages' login."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request

from app.deps import DatabaseDep, app_state  # also registers `{trace_id:trace}`
from app.review.agreement import GraderAgreement
from app.review.audit import AuditThresholds, RunAudit
from app.review.labels import RolloutLabels
from app.review.service import RolloutReview
from app.review.session import require_login
from app.review.statistics import RunStatistics


async def rollout_review(db: DatabaseDep) -> AsyncIterator[RolloutReview]:
    async with db.session() as session:
        yield RolloutReview(session)


async def rollout_review_writing(db: DatabaseDep) -> AsyncIterator[RolloutReview]:
    """The rollout review in one transaction, committed when the route returns."""
    async with db.session(write=True) as session:
        yield RolloutReview(session)


async def rollout_labels(db: DatabaseDep) -> AsyncIterator[RolloutLabels]:
    async with db.session() as session:
        yield RolloutLabels(session)


async def rollout_labels_writing(db: DatabaseDep) -> AsyncIterator[RolloutLabels]:
    """People's labels in one transaction, committed when the route returns."""
    async with db.session(write=True) as session:
        yield RolloutLabels(session)


async def grader_agreement(db: DatabaseDep) -> AsyncIterator[GraderAgreement]:
    async with db.session() as session:
        yield GraderAgreement(session)


async def run_audit(request: Request, db: DatabaseDep) -> AsyncIterator[RunAudit]:
    thresholds = AuditThresholds.from_settings(app_state(request.app).settings)
    async with db.session() as session:
        yield RunAudit(session, thresholds)


async def run_statistics(db: DatabaseDep) -> AsyncIterator[RunStatistics]:
    async with db.session() as session:
        yield RunStatistics(session, sessions=db.sessions)


# scope="function": the session ends (a write commits) before the answer is sent, so a failed
# commit is the answer (a 503), never a success the database did not keep.
RolloutReviewDep = Annotated[RolloutReview, Depends(rollout_review, scope="function")]
RolloutReviewWritingDep = Annotated[RolloutReview, Depends(rollout_review_writing, scope="function")]
RolloutLabelsDep = Annotated[RolloutLabels, Depends(rollout_labels, scope="function")]
RolloutLabelsWritingDep = Annotated[RolloutLabels, Depends(rollout_labels_writing, scope="function")]
GraderAgreementDep = Annotated[GraderAgreement, Depends(grader_agreement, scope="function")]
RunAuditDep = Annotated[RunAudit, Depends(run_audit, scope="function")]
RunStatisticsDep = Annotated[RunStatistics, Depends(run_statistics, scope="function")]
# A review page: a logged-in browser, else a redirect to the login that comes back to the page.
NEEDS_LOGIN = [Depends(require_login)]
