"""The tool-call fast path: exactly the two tool-call routes go through it, everything else to the app."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.calls.routes import NOT_A_TOOL_CALL, tool_call_pack, tool_call_target
from app.deps import app_state
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
        ("POST", "/packs/airline/tools/calculate", "", "calculate"),
        ("POST", "/packs/airline/tools", "", None),
        ("POST", "/sparring/packs/airline/tools/calculate", "/sparring", "calculate"),
        ("POST", "/packs//tools/calculate", "", NOT_A_TOOL_CALL),
        ("POST", "/packs/airline", "", NOT_A_TOOL_CALL),
        ("POST", "/packs/airline/tools/a/b", "", NOT_A_TOOL_CALL),
        ("POST", "/packs/airline/toolsx", "", NOT_A_TOOL_CALL),
        ("GET", "/tools/increment", "", NOT_A_TOOL_CALL),
        ("GET", "/tools", "", NOT_A_TOOL_CALL),
        ("POST", "/tools/", "", None),  # a trailing slash names the same route
        ("POST", "/tools/increment/", "", "increment"),
        ("POST", "/packs/airline/tools/calculate/", "", "calculate"),
        ("POST", "/tools//", "", NOT_A_TOOL_CALL),
        ("POST", "/tools/a/b/", "", NOT_A_TOOL_CALL),
        ("POST", "/tools/a/b", "", NOT_A_TOOL_CALL),
        ("POST", "/toolsx", "", NOT_A_TOOL_CALL),
        ("POST", "/grade/x", "", NOT_A_TOOL_CALL),
        ("POST", "/rollouts", "", NOT_A_TOOL_CALL),
    ],
)
def test_only_the_tool_call_routes_take_the_fast_path(
    method: str, path: str, root_path: str, target: str | None
) -> None:
    assert tool_call_target(scope(method, path, root_path)) == target


def test_a_pack_qualified_path_names_its_pack() -> None:
    assert tool_call_pack(scope("POST", "/packs/airline/tools/calculate")) == "airline"
    assert tool_call_pack(scope("POST", "/sparring/packs/retail/tools", "/sparring")) == "retail"
    assert tool_call_pack(scope("POST", "/tools/calculate")) is None


def test_websocket_and_lifespan_scopes_pass_through() -> None:
    assert tool_call_target({"type": "lifespan"}) == NOT_A_TOOL_CALL
    assert tool_call_target({"type": "websocket", "path": "/tools/x"}) == NOT_A_TOOL_CALL


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


async def test_a_bug_on_the_fast_path_is_a_json_500(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = app_state(client.app).call_service  # type: ignore[attr-defined]

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in sparring")

    monkeypatch.setattr(service, "call", broken)
    r = await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=new_trace()))
    assert r.status_code == 500
    assert r.json() == {
        "error": {"code": "internal_error", "message": "unexpected server error; see the server log"}
    }


async def test_a_client_gone_before_its_body_gets_no_answer(client: httpx.AsyncClient) -> None:
    from app.calls.routes import TOOL_SCOPE_KEY, serve_tool_call

    app = client.app  # type: ignore[attr-defined]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/tools/increment",
        "headers": [(b"authorization", f"Bearer {ADMIN_KEY}".encode())],
        "app": app,
        TOOL_SCOPE_KEY: "increment",
    }
    await serve_tool_call(scope, receive, send)
    assert sent == []


async def test_the_openapi_tool_routes_are_exactly_the_fast_path(client: httpx.AsyncClient) -> None:
    """The OpenAPI document cannot drift from the one tool-call implementation: same paths, same answer."""
    from app.calls.envelope import ToolCallOutput
    from app.calls.routes import (
        PACK_TOOL_PATH,
        PACK_TOOLS_PATH,
        PACK_USER_TOOL_PATH,
        TOOL_PATH,
        TOOLS_PATH,
        USER_TOOL_PATH,
    )

    r = await client.get("/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    document = r.json()
    posted = {path for path, methods in document["paths"].items() if "post" in methods}
    described = {
        path
        for path in posted
        if tool_call_target(scope("POST", path.replace("{name}", "x").replace("{pack}", "p")))
        != NOT_A_TOOL_CALL
    }
    assert described == {
        TOOLS_PATH,
        TOOL_PATH,
        PACK_TOOLS_PATH,
        PACK_TOOL_PATH,
        USER_TOOL_PATH,
        PACK_USER_TOOL_PATH,
    }
    for path in described:
        operation = document["paths"][path]["post"]
        answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer == {"$ref": "#/components/schemas/ToolCallOutput"}
        assert "application/json" in operation["requestBody"]["content"]
    output_schema = document["components"]["schemas"]["ToolCallOutput"]
    served = await client.post("/tools/echo", json=call_body({"text": "hi"}, trace_id=new_trace()))
    assert set(served.json()) == set(output_schema["properties"]) == set(ToolCallOutput.model_fields)


@pytest.mark.parametrize("fast_path", [True, False])
async def test_the_routes_answer_through_the_same_implementation(
    client: httpx.AsyncClient, fast_path: bool
) -> None:
    """With the fast path off, FastAPI's routes answer: the same call, the same checks, the same answers."""
    app = client.app  # type: ignore[attr-defined]
    if not fast_path:
        app.tool_calls = None
    trace = new_trace()
    ok = await client.post("/tools/increment", json=call_body({"by": 2}, trace_id=trace, call_id="c1"))
    assert ok.status_code == 200 and ok.json()["call_id"] == "c1"
    again = await client.post("/tools/increment", json=call_body({"by": 2}, trace_id=trace, call_id="c1"))
    assert again.json() == ok.json()  # the ledger answered the retry
    by_body = await client.post("/tools", json={**call_body({"by": 1}, trace_id=trace), "name": "increment"})
    assert by_body.status_code == 200 and by_body.json()["output"] != ok.json()["output"]
    mistake = await client.post("/tools/increment", json=call_body({"by": "x"}, trace_id=trace))
    assert mistake.status_code == 200 and mistake.json()["output"].startswith("Error: ")
    assert (await client.post("/tools/increment", content=b"[1]")).status_code == 400
    anonymous = await client.post("/tools/increment", json=call_body({}), headers={"Authorization": ""})
    assert anonymous.status_code == 401
