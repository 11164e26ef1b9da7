"""Reading rollouts back (admin): their calls in order, and their current state."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel

from app.db.text import storable
from app.deps import AdminKey, DatabaseDep, RegistryDep, StoreDep
from app.errors import NotFound
from app.rollouts.repository import RolloutRepository
from app.rollouts.timeline import RolloutCall, read_timeline
from app.sdk import RolloutState

router = APIRouter(prefix="/rollouts", tags=["rollouts"])


class RolloutOut(BaseModel):
    trace_id: str
    run: str | None
    channel: str | None
    item_key: str | None
    first_seen: datetime
    last_seen: datetime
    graded_at: datetime | None
    calls: int


class RolloutDetail(RolloutOut):
    parallel_batches: int
    timeline: list[RolloutCall]


@router.get("")
async def list_rollouts(
    _: AdminKey,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    run: str | None = None,
) -> list[RolloutOut]:
    async with db.session() as session:
        rows = await RolloutRepository(session).recent(limit=limit, run=run)
    # rollouts.calls counts the calls as read (app/db/call_log.py), kept by the log writer.
    return [RolloutOut.model_validate(r, from_attributes=True) for r in rows]


@router.get("/{trace_id}")
async def get_rollout(trace_id: str, _: AdminKey, db: DatabaseDep) -> RolloutDetail:
    """The rollout's calls in order with their parallel batches (the canonical read-back of a rollout;
    `/review/api/rollouts/{trace_id}` adds its grades and flags to the same timeline)."""
    async with db.session() as session:
        timeline = await read_timeline(session, trace_id)
    if timeline is None or timeline.first_seen is None or timeline.last_seen is None:
        raise NotFound(f"no rollout with trace_id {trace_id!r}")
    return RolloutDetail(
        trace_id=timeline.trace_id,
        run=timeline.run,
        channel=timeline.channel,
        item_key=timeline.item_key,
        first_seen=timeline.first_seen,
        last_seen=timeline.last_seen,
        graded_at=timeline.graded_at,
        calls=len(timeline.calls),
        parallel_batches=timeline.parallel_batches,
        timeline=list(timeline.calls),
    )


@router.get("/{trace_id}/state")
async def get_rollout_state(
    trace_id: str,
    _: AdminKey,
    store: StoreDep,
    registry: RegistryDep,
    db: DatabaseDep,
    changed_only: Annotated[
        bool, Query(description="Only the records this rollout changed, not the whole materialized state.")
    ] = False,
) -> dict[str, Any]:
    """The rollout's current state per pack, materialized (base plus this rollout's changes).

    Every pack the rollout changed or called a tool of (a rollout that changed nothing shows its base);
    404 for a rollout the server never saw.
    """
    trace_id = storable(trace_id)  # the key of the store and of the log alike (app/rollouts/identity.py)
    changes = await store.changes(trace_id)
    async with db.session() as session:
        timeline = await read_timeline(session, trace_id)
    if timeline is None and not changes and not await store.seen(trace_id):
        raise NotFound(f"no rollout with trace_id {trace_id!r}")
    called = {
        registry.tools[call.tool].pack
        for call in (timeline.calls if timeline is not None else ())
        if call.outcome == "ok" and call.tool in registry.tools
    }
    state: dict[str, Any] = {}
    for name, pack in registry.packs.items():
        pack_changes = changes.get(name, {})
        if not pack_changes and name not in called:
            continue
        state[name] = {"changed": pack_changes}
        if not changed_only:
            state[name]["state"] = RolloutState(pack.base(), pack_changes, writable=False).snapshot()
    return {"trace_id": trace_id, "packs": state}
