"""SPARRING_ENV_PROTOCOLS mounts the protocols; a pack name or a `submit` tool that clashes stops start."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.errors import StartupError
from app.sdk import Pack
from tests.conftest import AppFactory
from tests.packs import counter_pack


def test_the_setting_reads_a_list_and_refuses_unknown_protocols(tmp_path: Path) -> None:
    assert Settings(home=tmp_path).env_protocols == ["openenv", "ors"]
    assert Settings(home=tmp_path, env_protocols="ors, openenv").env_protocols == ["ors", "openenv"]
    assert Settings(home=tmp_path, env_protocols="").env_protocols == []
    with pytest.raises(ValidationError):
        Settings(home=tmp_path, env_protocols="ors,gym")


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_ors_is_served_by_default_and_not_when_left_out(app_factory: AppFactory) -> None:
    headers = {"X-API-Key": "tools-key-123"}
    async with app_factory(packs=[counter_pack]) as client:
        assert (await client.get("/list_environments", headers=headers)).json() == ["counter"]
    for protocols in ("", "openenv"):
        async with app_factory(packs=[counter_pack], env_protocols=protocols) as client:
            assert (await client.get("/list_environments", headers=headers)).status_code == 404
            assert (await client.post("/create_session", headers=headers)).status_code == 404
            assert (await client.get("/tools")).status_code == 200


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
@pytest.mark.parametrize("name", ["review", "create_session", "openenv", "Tools", "user-tools"])
async def test_a_pack_named_like_a_root_path_refuses_to_start_with_ors(
    app_factory: AppFactory, name: str
) -> None:
    clashing = Pack(name)
    with pytest.raises(StartupError, match="SPARRING_ENV_PROTOCOLS"):
        async with app_factory(packs=[clashing]):
            pass
    async with app_factory(packs=[clashing], env_protocols="openenv") as client:
        assert (await client.get("/tools")).status_code == 200


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_tool_named_submit_refuses_to_start_with_a_protocol(app_factory: AppFactory) -> None:
    pack = Pack("quiz")

    @pack.tool(name="submit")
    def submit_answer(answer: str) -> str:
        """Hand in an answer."""
        return answer

    with pytest.raises(StartupError, match="'submit'"):
        async with app_factory(packs=[pack]):
            pass
    async with app_factory(packs=[pack], env_protocols="") as client:
        assert [t["name"] for t in (await client.get("/tools")).json()] == ["submit"]
