"""The tool-call fast path: exactly the two tool-call routes go through it, everything else to the app."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.calls.routes import _NOT_A_TOOL_CALL, _tool_call_target
from tests.conftest import ADMIN_KEY, call_body, new_trace


def scope(method: str, path: str, root_path: str = "") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": root_path}


@pytest.mark.parametrize(
    ("method", "path", "root_path", "target"),
    [
        ("POST", "/tools/increment", "", "increment"),
        ("POST", "/tools", "", None),
        ("POST", "/sparring/tools/increment", "/sparring", "increment"),
        ("POST", "/sparring/tools", "/sparring", None),
        ("GET", "/tools/increment", "", _NOT_A_TOOL_CALL),
        ("GET", "/tools", "", _NOT_A_TOOL_CALL),
        ("POST", "/tools/", "", _NOT_A_TOOL_CALL),
        ("POST", "/tools/a/b", "", _NOT_A_TOOL_CALL),
        ("POST", "/toolsx", "", _NOT_A_TOOL_CALL),
        ("POST", "/grade/x", "", _NOT_A_TOOL_CALL),
        ("POST", "/rollouts", "", _NOT_A_TOOL_CALL),
    ],
)
def test_only_the_tool_call_routes_take_the_fast_path(
    method: str, path: str, root_path: str, target: str | None
) -> None:
    assert _tool_call_target(scope(method, path, root_path)) == target


def test_websocket_and_lifespan_scopes_pass_through() -> None:
    assert _tool_call_target({"type": "lifespan"}) == _NOT_A_TOOL_CALL
    assert _tool_call_target({"type": "websocket", "path": "/tools/x"}) == _NOT_A_TOOL_CALL


async def test_other_routes_behave_as_before(client: httpx.AsyncClient) -> None:
    listed = await client.get("/tools")
    assert listed.status_code == 200 and "increment" in {tool["name"] for tool in listed.json()}
    assert (await client.post("/tools/a/b", json=call_body({}))).status_code == 404
    assert (await client.get("/tools/increment")).status_code == 405


async def test_errors_on_the_fast_path_keep_their_status_and_body(client: httpx.AsyncClient) -> None:
    r = await client.post("/tools/increment", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
    anonymous = await client.post(
        "/tools/increment", json=call_body({"by": 1}, trace_id=new_trace()), headers={"Authorization": ""}
    )
    assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"] == "Bearer"
    assert anonymous.json()["error"]["code"] == "unauthorized"


async def test_the_openapi_document_still_describes_the_tool_routes(client: httpx.AsyncClient) -> None:
    r = await client.get("/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert "post" in paths["/tools/{name}"] and "post" in paths["/tools"]
