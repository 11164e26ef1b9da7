"""Pack start-up hooks: run with the server's settings, then the base is loaded, both off the event loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings
from app.errors import StartupError
from app.sdk import Base, Pack, ToolContext
from tests.conftest import AppFactory, call_body, new_trace


async def test_hooks_run_with_the_settings_then_the_base_loads_once_before_any_call(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    loop_thread = threading.get_ident()
    events: list[tuple[str, Any, int]] = []

    def load() -> Base:
        events.append(("base", None, threading.get_ident()))
        return {"things": {"a": {"value": 1}}}

    pack = Pack("started", base=load)

    @pack.on_startup
    def first(settings: Settings) -> None:
        events.append(("first", settings.home, threading.get_ident()))

    @pack.on_startup
    def second(settings: Settings) -> None:
        events.append(("second", settings.home, threading.get_ident()))

    @pack.tool
    def read_thing(ctx: ToolContext) -> dict[str, int]:
        """Read the thing."""
        return dict(ctx.state.get("things", "a"))

    async with app_factory(packs=[pack]) as client:
        assert [name for name, _, _ in events] == ["first", "second", "base"]  # before any call
        response = await client.post("/tools/read_thing", json=call_body({}, trace_id=new_trace()))
        assert response.json()["output"] == '{"value":1}'
    assert [name for name, _, _ in events] == ["first", "second", "base"]  # the call reused it
    assert events[0][1] == events[1][1] == tmp_path / "home"
    assert all(thread != loop_thread for _, _, thread in events)  # the event loop was never blocked


@pytest.mark.parametrize("where", ["hook", "base"])
async def test_a_pack_that_cannot_start_stops_the_server_with_its_reason(
    app_factory: AppFactory, where: str
) -> None:
    def load() -> Base:
        if where == "base":
            raise OSError("things.json is unreadable")
        return {}

    pack = Pack("broken", base=load)

    @pack.on_startup
    def check(settings: Settings) -> None:
        if where == "hook":
            raise RuntimeError("the data directory is empty")

    reason = "things.json is unreadable" if where == "base" else "the data directory is empty"
    with pytest.raises(StartupError, match=f"pack 'broken' cannot start: {reason}"):
        async with app_factory(packs=[pack]):
            pass
