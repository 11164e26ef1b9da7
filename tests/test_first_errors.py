"""The errors a new user meets first say what to do: a key sent without `Bearer `, and a grade asked of
a server with no grader configured."""

from __future__ import annotations

import pytest

from tests.conftest import ADMIN_KEY, GRADER_KEY, TOOLS_KEY, AppFactory


@pytest.mark.parametrize(
    ("path", "key"), [("/tools", TOOLS_KEY), ("/review/api/runs", ADMIN_KEY), ("/grade", GRADER_KEY)]
)
async def test_a_key_without_bearer_is_told_so(app_factory: AppFactory, path: str, key: str) -> None:
    async with app_factory(key=None) as client:
        bare = await client.get(path, headers={"Authorization": key})
        empty = await client.get(path, headers={"Authorization": "Bearer "})
        missing = await client.get(path)
    assert bare.status_code == 401
    assert bare.json()["error"]["code"] == "unauthorized"
    assert "'Bearer ' before the key is missing" in bare.json()["error"]["message"]
    assert empty.status_code == 401 and "without a key" in empty.json()["error"]["message"]
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/grade", "/grade/retail"])
async def test_a_grade_with_no_grader_configured_names_the_graders_file(
    app_factory: AppFactory, path: str
) -> None:
    async with app_factory(packs=[], key=GRADER_KEY) as client:
        response = await client.post(path, content=b"{}")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "not_found"
    assert "none is configured" in error["message"] and "SPARRING_GRADERS_FILE" in error["message"]
