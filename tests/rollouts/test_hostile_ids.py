"""The admin read routes as a hostile or careless client calls them: a clear 4xx, never a 5xx."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from tests.conftest import ADMIN_KEY, new_trace

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.mark.parametrize("bad", ["a\x00b", "a\r\nSet-Cookie: x=1", "a\tb"], ids=["nul", "crlf", "tab"])
async def test_control_characters_in_rollout_ids_and_filters_are_a_400(
    client: httpx.AsyncClient, bad: str
) -> None:
    requests = [
        ("/rollouts", {"run": bad}),
        (f"/rollouts/{quote(bad)}", {}),
        (f"/rollouts/{quote(bad)}/state", {}),
        (f"/rollouts/{new_trace()}/state", {"changed_only": bad}),
    ]
    for path, params in requests:
        response = await client.get(path, params=params, headers=ADMIN)
        assert response.status_code == 400, (path, response.status_code, response.text[:200])
        assert response.json()["error"]["code"] == "bad_request"


async def test_a_query_of_the_wrong_type_is_a_422_with_the_stable_body(client: httpx.AsyncClient) -> None:
    for params in ({"limit": "many"}, {"limit": "NaN"}, {"limit": "0"}):
        response = await client.get("/rollouts", params=params, headers=ADMIN)
        assert response.status_code == 422, response.text[:200]
        error = response.json()["error"]
        assert error["code"] == "invalid_request" and error["details"]["errors"][0]["loc"] == [
            "query",
            "limit",
        ]


async def test_a_rollout_id_of_unusual_but_printable_text_is_looked_up(client: httpx.AsyncClient) -> None:
    for trace in (f"{new_trace()}-ünïcode €", "x" * 5000):
        response = await client.get(f"/rollouts/{quote(trace)}", headers=ADMIN)
        assert response.status_code == 404, response.text[:200]
