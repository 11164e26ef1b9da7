"""A rollout's current state (admin). Its list and its calls are read through app/review/api.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from app.deps import AdminKey, DatabaseDep, GraderKey, RegistryDep, StoreDep, reject_control_characters
from app.errors import NotFound
from app.rollouts.timeline import read_timeline
from app.rollouts.transcripts import TranscriptRepository, checked_conversation
from app.sdk import RolloutState

# Ids and filters with a control character are a 400 here as in the review API (app/deps.py).
router = APIRouter(prefix="/rollouts", tags=["rollouts"], dependencies=[Depends(reject_control_characters)])


@router.get("/{trace_id:trace}/state")
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
    changes = await store.changes(trace_id)
    async with db.session() as session:
        timeline = await read_timeline(session, trace_id)
    if timeline is None and not changes and not await store.seen(trace_id):
        raise NotFound(f"no rollout with trace_id {trace_id!r}")
    called = {
        registry.tools[call.tool].pack
        for call in (timeline.timeline if timeline is not None else ())
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


@router.put(
    "/{trace_id:trace}/transcript",
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    },
)
async def put_transcript(trace_id: str, request: Request, _: GraderKey, db: DatabaseDep) -> dict[str, Any]:
    """Store the rollout's conversation (the shape of `sparring.conversation`), replacing an earlier one.

    `{"model": ..., "source": ..., "messages": [{"role": "system" | "user" | "simulated_user" |
    "assistant" | "tool", "content": ..., "reasoning": ..., "tool_calls": [{"call_id", "name",
    "arguments"}], "call_id": ...}]}`; a grader or admin key; 400 naming the bad field, 413 past
    SPARRING_MAX_BODY_BYTES. The rollout need not have logged a call yet.
    """
    body = await request.body()
    conversation = checked_conversation(body)
    async with db.session(write=True) as session:
        await TranscriptRepository(session).put(trace_id, conversation, len(body))
    return {"trace_id": trace_id, "messages": len(conversation["messages"]), "size_bytes": len(body)}
