"""A rollout's timeline: its logged calls in start order, numbered, with their parallel batches."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel

from app.db.models import ToolCall
from app.rollouts.repository import parallel_batches


class CallOut(BaseModel):
    seq: int
    batch: int
    tool: str
    call_id: str | None
    arguments: str
    output: str | None
    output_bytes: int
    outcome: str
    error: str | None
    status_code: int
    started_at: datetime
    ended_at: datetime
    latency_ms: float
    worker: str


_LOGGED = tuple(name for name in CallOut.model_fields if name not in ("seq", "batch"))


def timeline(calls: Sequence[ToolCall]) -> list[CallOut]:
    """The logged calls in start order, numbered, with the parallel batch each belongs to."""
    batches = parallel_batches(calls)
    return [
        CallOut(seq=i, batch=batches[i], **{name: getattr(c, name) for name in _LOGGED})
        for i, c in enumerate(calls)
    ]
