"""A rollout's conversation beside its calls: checked, stored and read (shape: sparring.conversation).

sparring's own loop stores one for every rollout it runs (eval and canary through
`PUT /rollouts/{trace_id}/transcript`, remote rollouts in-process through `DatabaseTranscripts`); a
trainer running its own loop may PUT one too. The review's rollout page shows it with the logged calls,
matched by `call_id` (fitted here as the call log keys it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import RolloutRow, TranscriptRow
from app.db.session import Database
from app.errors import BadRequest
from app.rollouts.shapes import TranscriptOut
from sparring.conversation import conversation_of, parse_conversation
from sparring.loop import RolloutResult
from sparring.wire import call_key, storable

log = logging.getLogger(__name__)


def checked_conversation(body: bytes) -> dict[str, Any]:
    """A PUT body as a stored conversation; BadRequest naming what is wrong."""
    try:
        data = orjson.loads(body) if body.strip() else None
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    try:
        return keyed(parse_conversation(data))
    except ValueError as exc:
        raise BadRequest(f"bad transcript: {exc}") from exc


def keyed(conversation: dict[str, Any]) -> dict[str, Any]:
    """The conversation as it is stored: NUL-free, its call ids fitted as the call log keys them."""
    for message in conversation["messages"]:
        for call in message.get("tool_calls") or ():
            call["call_id"] = call_key(call["call_id"])
        if message["role"] == "tool":
            message["call_id"] = call_key(message["call_id"])
    return storable(conversation)


class TranscriptRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def put(self, trace_id: str, conversation: Mapping[str, Any], size_bytes: int) -> None:
        """Store (or replace) the rollout's conversation."""
        dialect = self.session.get_bind().dialect.name
        insert: Any = postgresql.insert if dialect == "postgresql" else sqlite.insert
        values = {
            "trace_id": trace_id,
            "model": conversation.get("model"),
            "source": conversation.get("source"),
            "messages": conversation["messages"],
            "size_bytes": size_bytes,
            "stored_at": datetime.now(UTC),
        }
        statement = insert(TranscriptRow).values(**values)
        replaced = {name: statement.excluded[name] for name in values if name != "trace_id"}
        await self.session.execute(
            statement.on_conflict_do_update(index_elements=[TranscriptRow.trace_id], set_=replaced)
        )

    async def get(self, trace_id: str) -> TranscriptOut | None:
        row = await self.session.get(TranscriptRow, trace_id)
        return transcript_out(row) if row is not None else None

    async def for_traces(self, trace_ids: Iterable[str]) -> dict[str, TranscriptOut]:
        ids = list(trace_ids)
        if not ids:
            return {}
        rows = (
            await self.session.scalars(select(TranscriptRow).where(TranscriptRow.trace_id.in_(ids)))
        ).all()
        return {row.trace_id: transcript_out(row) for row in rows}

    async def models_of_runs(self, runs: Iterable[str]) -> dict[str, list[str]]:
        """The models named by each run's stored conversations (most rollouts first)."""
        names = list(runs)
        if not names:
            return {}
        rows = (
            await self.session.execute(
                select(RolloutRow.run, TranscriptRow.model)
                .join(TranscriptRow, TranscriptRow.trace_id == RolloutRow.trace_id)
                .where(RolloutRow.run.in_(names), TranscriptRow.model.is_not(None))
                .group_by(RolloutRow.run, TranscriptRow.model)
                .order_by(RolloutRow.run, func.count().desc())
            )
        ).all()
        models: dict[str, list[str]] = {}
        for run, model in rows:
            if run is not None and model is not None:
                models.setdefault(run, []).append(model)
        return models


def transcript_out(row: TranscriptRow) -> TranscriptOut:
    return TranscriptOut(
        model=row.model,
        source=row.source,
        messages=row.messages,
        size_bytes=row.size_bytes,
        stored_at=row.stored_at,
    )


class DatabaseTranscripts:
    """Keeps the conversations of the rollouts the server runs itself (remote rollouts), best effort."""

    def __init__(self, database: Database, *, source: str) -> None:
        self.database = database
        self.source = source

    async def store(self, result: RolloutResult, model: str | None = None) -> None:
        conversation = keyed(conversation_of(result, model=model, source=self.source))
        size = len(orjson.dumps(conversation))
        try:
            async with self.database.session(write=True) as session:
                await TranscriptRepository(session).put(result.trace_id, conversation, size)
        except Exception as exc:  # an outage loses the conversation, never the rollout's outcome
            log.warning("the transcript of %s was not stored: %s", result.trace_id, exc)
