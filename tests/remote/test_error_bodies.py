"""Every 4xx of the remote and admin routes answers the stable error body of the tool routes
(`{"error": {"code", "message"}}`), and the init takes a JSON body sent without a Content-Type (as
`curl -d` sends it, and as the tool routes take theirs)."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, TOOLS_KEY, AppFactory
from tests.remote.processor import Row, init_request

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOOLS = {"Authorization": f"Bearer {TOOLS_KEY}"}


def stable(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}, body  # never FastAPI's {"detail": ...}
    assert body["error"]["code"] == code and isinstance(body["error"]["message"], str), body
    return dict(body["error"])


def refused_base_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/v1"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
async def test_remote_init_reads_json_whatever_the_content_type(
    app_factory: AppFactory, content_type: str | None
) -> None:
    body = init_request(
        Row.new(), model="m", model_base_url=refused_base_url(), messages=[{"role": "user", "content": "hi"}]
    )
    headers = dict(TOOLS)
    if content_type is not None:
        headers["content-type"] = content_type
    async with app_factory(key=None) as client:
        # content= sends the bytes as they are: no Content-Type unless given (curl -d sends form's).
        response = await client.post("/remote/init", content=json.dumps(body).encode(), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] is True


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        ("GET", "/remote/init", TOOLS, 405, "method_not_allowed"),
        ("POST", "/remote/status", TOOLS, 405, "method_not_allowed"),
        ("GET", "/remote/status", TOOLS, 422, "invalid_request"),
        ("GET", "/remote/nope", TOOLS, 404, "not_found"),
        ("POST", "/remote/init", {}, 401, "unauthorized"),
        ("GET", "/review/api/nope", ADMIN, 404, "not_found"),
        ("DELETE", "/review/api/runs", ADMIN, 405, "method_not_allowed"),
        ("GET", "/review/api/stats", ADMIN, 422, "invalid_request"),
        ("GET", "/review/api/runs", TOOLS, 403, "forbidden"),
        ("GET", "/rollouts/trace_none/state", ADMIN, 404, "not_found"),
        ("PUT", "/rollouts/trace_none/state", ADMIN, 405, "method_not_allowed"),
        ("GET", "/metrics", {}, 401, "unauthorized"),
    ],
)
async def test_remote_and_admin_4xx_answer_the_stable_error_body(
    app_factory: AppFactory, method: str, path: str, headers: dict[str, str], status: int, code: str
) -> None:
    async with app_factory(key=None) as client:
        response = await client.request(method, path, headers=headers, content=b"{}")
    error = stable(response, status, code)
    if status == 405:
        assert response.headers["allow"] and method not in response.headers["allow"]
        assert method in error["message"]
