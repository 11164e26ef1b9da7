"""Init and status requests as a hostile or careless processor sends them: a 4xx with the stable error
body, never a 5xx, and nothing stored that later breaks a read of the log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, AppFactory
from tests.remote.model_server import ModelServer, Turn
from tests.remote.processor import Row, init_request, wait_terminated

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = [{"role": "user", "content": "Say hi."}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    server.scripts["hi"] = [Turn(text="hi")]
    server.scripts["nul"] = [Turn(text="hi\x00there")]
    server.start()
    yield server
    server.stop()


def nest(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


def deep(levels: int) -> str:
    """JSON text of objects nested `levels` deep (deeper than Python's json module writes)."""
    return '{"a":' * levels + '"x"' + "}" * levels


def body_text(**extra: Any) -> str:
    """An init request's JSON text; `extra` fields are spliced in as raw JSON text."""
    body = init_request(Row.new(), model="hi", model_base_url="https://models.example/v1", messages=USER)
    text = json.dumps(body)
    for name, raw in extra.items():
        text = text[:-1] + f', "{name}": {raw}}}'
    return text


def with_rollout_id(rollout_id: str) -> str:
    body = init_request(Row.new(), model="hi", model_base_url="https://models.example/v1", messages=USER)
    body["metadata"]["rollout_id"] = rollout_id
    return json.dumps(body)


def assert_refused(response: httpx.Response, what: str) -> None:
    assert response.status_code in (400, 422), (what, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str), (what, error)


HOSTILE_INITS: dict[str, str] = {
    # Not numbers JSON has: NaN, Infinity, and a literal past the largest double.
    "nan in completion_params": body_text().replace('"temperature": 0.0', '"temperature": NaN'),
    "infinity in completion_params": body_text().replace('"temperature": 0.0', '"temperature": -Infinity'),
    "1e400 in completion_params": body_text().replace('"temperature": 0.0', '"temperature": 1e400'),
    "nan in item": body_text(item='{"id": "r1", "weight": NaN}'),
    "1e400 in item": body_text(item='{"id": "r1", "weight": 1e400}'),
    "nan as completion_params": body_text().replace(
        '"completion_params": {"model": "hi", "temperature": 0.0}', '"completion_params": NaN'
    ),
    "nan as messages": body_text().replace(
        '"messages": [{"role": "user", "content": "Say hi."}]', '"messages": [NaN]'
    ),
    # A lone surrogate: JSON text no UTF-8 encoder writes back.
    "lone surrogate in a message": body_text().replace("Say hi.", "Say \\ud800 hi."),
    "lone surrogate in the rollout id": with_rollout_id("r-\ud800"),
    "lone surrogate as messages": body_text().replace(
        '"messages": [{"role": "user", "content": "Say hi."}]', '"messages": "\\udfff"'
    ),
    # NUL: no database text holds it.
    "nul in the rollout id": with_rollout_id("r-\x00-1"),
    "nul in a message": body_text().replace("Say hi.", "Say \\u0000 hi."),
    "nul in the model": body_text().replace('"model": "hi"', '"model": "h\\u0000i"'),
    "nul in the item": body_text(item='{"id": "r\\u00001"}'),
    "nul in a metadata id": body_text().replace('"run_id": "run-1"', '"run_id": "run\\u0000"'),
    "nul in a key": body_text(item='{"i\\u0000d": "r1"}'),
    # A rollout id longer than its column.
    "5000-character rollout id": with_rollout_id("r" * 5000),
    # Nested past the rule of the tool and grade routes (128 levels).
    "item nested 300 levels": body_text(item=deep(300)),
    "item nested 129 levels": body_text(item=deep(129)),
    "messages nested 300 levels": body_text().replace(
        '"content": "Say hi."', f'"content": "Say hi.", "extra": {deep(300)}'
    ),
    "tools nested 300 levels": body_text().replace('"tools": null', f'"tools": [{deep(300)}]'),
    "completion_params nested 300 levels": body_text().replace(
        '"temperature": 0.0', f'"temperature": 0.0, "logit_bias": {deep(300)}'
    ),
    "metadata nested 1000 levels": body_text().replace('"row_id": "row-1"', f'"row_id": {deep(1000)}'),
    # Not even JSON, or not an object.
    "not json": "{",
    "a list": "[1, 2]",
    "wrong types": '{"completion_params": 5, "messages": {"a": 1}, "metadata": []}',
}


@pytest.mark.parametrize("case", list(HOSTILE_INITS))
async def test_a_hostile_init_is_a_4xx_with_the_stable_body(app_factory: AppFactory, case: str) -> None:
    async with app_factory() as client:
        response = await client.post("/remote/init", content=HOSTILE_INITS[case], headers=JSON)
        assert_refused(response, case)
        # Nothing was stored that breaks reading the log back.
        export = await client.get("/export", headers=ADMIN)
        assert export.status_code == 200, export.text[:300]


@pytest.mark.parametrize(
    "rollout_id", ["r\x00", "r" * 5000, "r\r\nx", "\ud800"], ids=["nul", "5000", "crlf", "surrogate"]
)
async def test_a_hostile_status_query_is_a_4xx_with_the_stable_body(
    app_factory: AppFactory, rollout_id: str
) -> None:
    async with app_factory() as client:
        encoded = rollout_id.encode("utf-8", "surrogatepass")
        response = await client.get("/remote/status", params={"rollout_id": encoded})
        assert response.status_code in (400, 404, 422), response.text[:300]
        assert isinstance(response.json()["error"]["message"], str)


async def test_a_rollout_as_deep_and_long_as_real_ones_runs(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row(rollout_id="r" * 200)
    async with app_factory() as client:
        body = init_request(
            row,
            model="hi",
            model_base_url=model.base_url(),
            messages=USER,
            item={"id": "r1", "deep": nest(100)},
        )
        accepted = await client.post("/remote/init", json=body)
        assert accepted.status_code == 200, accepted.text
        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["state"] == "finished", status
        export = await client.get("/export", headers=ADMIN)
        assert export.status_code == 200, export.text[:300]


async def test_a_validation_error_echoing_what_no_encoder_writes_is_a_422_with_the_stable_body(
    client: httpx.AsyncClient,
) -> None:
    # FastAPI's own 422 echoes the failed input; NaN, a lone surrogate or a deep list there made the
    # answer itself fail (a 500). Sparring's answer names where and why, never the value.
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import Request

    from app.errors import handle_validation_error

    deep_list: Any = []
    for _ in range(1000):
        deep_list = [deep_list]
    errors = [
        {"loc": ("body", "temperature"), "msg": "bad", "type": "float_type", "input": float("nan")},
        {"loc": ("body", "x\ud800"), "msg": "bad \udfff", "type": "string_type", "input": "\ud800"},
        {"loc": ("body", "tools", 0), "msg": "bad", "type": "list_type", "input": deep_list},
    ]
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""})
    response = await handle_validation_error(request, RequestValidationError(errors))
    assert response.status_code == 422
    error = json.loads(bytes(response.body))["error"]
    assert error["code"] == "invalid_request"
    assert [e["loc"] for e in error["details"]["errors"]] == [
        ["body", "temperature"],
        ["body", "x?"],
        ["body", "tools", 0],
    ]
    # And through the app: a query parameter of the wrong type.
    answer = await client.get("/remote/status")
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_request", answer.text


async def test_a_model_answering_nul_ends_the_rollout_recorded(
    app_factory: AppFactory, model: ModelServer
) -> None:
    # The outcome (its summary holds the model's final text) is stored as Postgres can hold it, NUL as
    # U+FFFD; unstorable, the rollout stayed `running` until its lease lapsed and then read as lost.
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="nul", model_base_url=model.base_url(), messages=USER)
        assert (await client.post("/remote/init", json=body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id, polls=200)
        assert status["state"] == "finished", status
        assert status["info"]["final_text"] == "hi\ufffdthere"


async def test_a_model_answering_a_lone_surrogate_ends_the_rollout_recorded(
    app_factory: AppFactory, model: ModelServer
) -> None:
    # JSON can escape a lone surrogate, which no UTF-8 encoder (nor Postgres) takes: it reads as U+FFFD.
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="surrogate", model_base_url=model.base_url(), messages=USER)
        assert (await client.post("/remote/init", json=body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id, polls=200)
        assert status["state"] == "finished", status
        assert status["info"]["final_text"] == "103 \ufffd"
