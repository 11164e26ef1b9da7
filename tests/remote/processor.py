"""A client that speaks the remote rollout contract as eval-protocol 0.3.33's RemoteRolloutProcessor does.

It posts `InitRequest.model_dump()` (completion_params, messages, tools, model_base_url, metadata,
api_key) to `<remote>/init` and polls `<remote>/status?rollout_id=` until `terminated`; a 5xx on init
is a retryable ConnectionError there, so it is retried here after the answer's Retry-After.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Row:
    """The ids eval-protocol puts in an init request's metadata."""

    rollout_id: str
    invocation_id: str = "inv-1"
    experiment_id: str = "exp-1"
    run_id: str = "run-1"
    row_id: str = "row-1"

    @classmethod
    def new(cls, **ids: str) -> Row:
        return cls(rollout_id=f"rollout-{uuid.uuid4().hex[:12]}", **ids)


def init_request(
    row: Row,
    *,
    model: str,
    model_base_url: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "completion_params": {"model": model, "temperature": 0.0},
        "messages": messages,
        "tools": tools,
        "model_base_url": model_base_url,
        "metadata": {
            "invocation_id": row.invocation_id,
            "experiment_id": row.experiment_id,
            "rollout_id": row.rollout_id,
            "run_id": row.run_id,
            "row_id": row.row_id,
        },
        "api_key": "trainer-model-key",
    }
    body.update(extra)
    return body


async def post_init(
    client: httpx.AsyncClient, remote: str, body: dict[str, Any], *, attempts: int = 50
) -> httpx.Response:
    """POST /init, retrying a 5xx as the processor's retry policy does (bounded)."""
    response = await client.post(f"{remote}/init", json=body)
    for _ in range(attempts):
        if response.status_code < 500:
            return response
        await asyncio.sleep(min(float(response.headers.get("retry-after", "1")), 0.2))
        response = await client.post(f"{remote}/init", json=body)
    return response


async def wait_terminated(
    client: httpx.AsyncClient, remote: str, rollout_id: str, *, polls: int = 600, interval: float = 0.05
) -> dict[str, Any]:
    """Poll /status until `terminated` (bounded); the last status otherwise."""
    status: dict[str, Any] = {}
    for _ in range(polls):
        response = await client.get(f"{remote}/status", params={"rollout_id": rollout_id})
        assert response.status_code == 200, response.text
        status = response.json()
        if status["terminated"]:
            return status
        await asyncio.sleep(interval)
    raise AssertionError(f"rollout {rollout_id} did not terminate: {status}")


async def wait_gateway_status(
    gateway: str, rollout_id: str, *, polls: int = 600, interval: float = 0.05
) -> dict[str, Any]:
    """Poll the tracing gateway's /v1/status as eval-protocol 0.3.33's processor does, until a code other
    than RUNNING (101) appears (bounded)."""
    async with httpx.AsyncClient(base_url=gateway) as client:
        for _ in range(polls):
            answer = (await client.get("/v1/status", params={"rollout_id": rollout_id})).json()
            status = answer.get("status")
            if isinstance(status, dict) and status.get("code") != 101:
                return status
            await asyncio.sleep(interval)
    raise AssertionError(f"the gateway never saw rollout {rollout_id} end")
