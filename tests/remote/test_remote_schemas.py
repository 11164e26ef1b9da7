"""The remote routes declare what they answer: typed response models, visible in the OpenAPI document."""

from __future__ import annotations

import httpx

from tests.conftest import ADMIN_KEY


async def test_init_and_status_declare_their_response_models(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()
    paths = document["paths"]

    def answer_schema(path: str, method: str) -> str:
        return str(paths[path][method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"])

    assert answer_schema("/remote/init", "post").endswith("/InitResponse")
    assert answer_schema("/remote/status", "get").endswith("/StatusResponse")
    status = document["components"]["schemas"]["StatusResponse"]
    assert {
        "terminated",
        "rollout_id",
        "trace_id",
        "attempt",
        "state",
        "reason",
        "reward",
        "status",
        "info",
    } == set(status["properties"])
