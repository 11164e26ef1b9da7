"""Pack lifespans: own settings (SPARRING_<PACK>_*), resources for tools and checks, start-up and shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import AliasChoices, Field

import app.lifespan
from app.errors import StartupError
from app.packs import PackLoadError, Registry
from app.sdk import (
    Base,
    CheckResult,
    Pack,
    PackSettings,
    PackStart,
    RolloutState,
    RolloutView,
    ToolContext,
    ToolDefinitionError,
    pack_settings_config,
)
from tests.conftest import ADMIN_KEY, AppFactory, call_body, new_trace


class NotesSettings(PackSettings):
    model_config = pack_settings_config("notes")

    greeting: str = "hello"
    # A variable named before the prefix rule keeps working next to the prefixed one.
    directory: Path | None = Field(
        None, validation_alias=AliasChoices("SPARRING_NOTES_DIRECTORY", "SPARRING_NOTEBOOK_DIR")
    )


@dataclass
class Notebook:
    greeting: str
    directory: Path | None
    loop: asyncio.AbstractEventLoop
    closed: bool = False
    events: list[str] = field(default_factory=list)


def notes_pack(started: list[Notebook], *, base: Any = None) -> Pack:
    @asynccontextmanager
    async def lifespan(start: PackStart[NotesSettings]) -> AsyncIterator[Notebook]:
        notebook = Notebook(start.settings.greeting, start.settings.directory, asyncio.get_running_loop())
        started.append(notebook)
        try:
            yield notebook
        finally:
            notebook.closed = True

    pack = Pack("notes", settings=NotesSettings, lifespan=lifespan, base=base)

    @pack.tool
    async def greet(ctx: ToolContext) -> str:
        """Greet with the configured greeting."""
        notebook = ctx.resource(Notebook)
        assert asyncio.get_running_loop() is notebook.loop  # the app's own loop
        return f"{notebook.greeting} from {notebook.directory}"

    @pack.state_check("notes")
    def check(view: RolloutView) -> CheckResult:
        view.resource(Notebook).events.append("checked")
        return CheckResult(score=1.0)

    return pack


async def test_a_pack_gets_its_own_settings_and_its_resources_reach_tools_and_checks(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPARRING_NOTES_GREETING", "bonjour")
    monkeypatch.setenv("SPARRING_NOTEBOOK_DIR", str(tmp_path))  # the older name
    started: list[Notebook] = []
    async with app_factory(packs=[notes_pack(started)], key=ADMIN_KEY) as client:
        assert len(started) == 1 and not started[0].closed  # started before any call
        response = await client.post("/tools/greet", json=call_body({}, trace_id=new_trace()))
        assert response.json()["output"] == f"bonjour from {tmp_path}"
        grade = await client.post("/grade/notes", json={"sample": {"output_text": "x"}, "item": {}})
        assert grade.status_code == 200 and grade.json()["score"] == 1.0
        assert started[0].events == ["checked"]
    assert started[0].closed  # shut down with the app


async def test_settings_given_in_code_win_over_the_environment(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPARRING_NOTES_GREETING", "bonjour")
    started: list[Notebook] = []
    overrides = {"notes": {"greeting": "hi", "directory": tmp_path}}
    async with app_factory(packs=[notes_pack(started)], pack_settings=overrides):
        assert (started[0].greeting, started[0].directory) == ("hi", tmp_path)


async def test_the_base_loads_once_after_the_lifespan_and_off_the_event_loop(app_factory: AppFactory) -> None:
    loop_thread = threading.get_ident()
    loads: list[int] = []
    started: list[Notebook] = []

    def load(resources: Notebook) -> Base:
        assert resources is started[0] and not resources.closed  # the lifespan ran first, and gave these
        loads.append(threading.get_ident())
        return {"things": {"a": {"value": 1}}}

    pack = notes_pack(started, base=load)

    @pack.tool
    def read_thing(ctx: ToolContext) -> dict[str, int]:
        """Read the thing."""
        return dict(ctx.state.get("things", "a"))

    async with app_factory(packs=[pack]) as client:
        assert len(loads) == 1
        response = await client.post("/tools/read_thing", json=call_body({}, trace_id=new_trace()))
        assert response.json()["output"] == '{"value":1}'
    assert len(loads) == 1 and loads[0] != loop_thread


@pytest.mark.parametrize("where", ["lifespan", "base", "settings"])
async def test_a_pack_that_cannot_start_stops_the_server_with_its_reason(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    def load(resources: None) -> Base:
        raise OSError("things.json is unreadable")

    @asynccontextmanager
    async def broken(start: PackStart[NotesSettings]) -> AsyncIterator[None]:
        raise RuntimeError("the data directory is empty")
        yield None

    if where == "settings":
        monkeypatch.setenv("SPARRING_BROKEN_LIMIT", "many")

    class BrokenSettings(PackSettings):
        model_config = pack_settings_config("broken")
        limit: int = 1

    pack = Pack(
        "broken",
        settings=BrokenSettings,
        base=load if where == "base" else None,
        lifespan=broken if where == "lifespan" else None,
    )
    reason = {
        "base": "things.json is unreadable",
        "lifespan": "the data directory is empty",
        "settings": "limit",
    }[where]
    with pytest.raises(StartupError, match=f"(?s)pack 'broken' cannot start: .*{reason}"):
        async with app_factory(packs=[pack]):
            pass


async def test_a_failed_start_stops_what_had_started_in_reverse_order(app_factory: AppFactory) -> None:
    order: list[str] = []

    def pack_named(name: str, *, fails: bool = False) -> Pack:
        @asynccontextmanager
        async def lifespan(start: PackStart[PackSettings]) -> AsyncIterator[None]:
            if fails:
                raise RuntimeError(f"{name} cannot start")
            order.append(f"start {name}")
            try:
                yield None
            finally:
                order.append(f"stop {name}")

        return Pack(name, lifespan=lifespan)

    packs = [pack_named("first"), pack_named("second"), pack_named("third", fails=True)]
    with pytest.raises(StartupError, match="third cannot start"):
        async with app_factory(packs=packs):
            pass
    assert order == ["start first", "start second", "stop second", "stop first"]


async def test_a_later_start_up_step_that_fails_stops_the_packs(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_schema(engine: Any) -> None:
        raise StartupError("the database schema is behind")

    monkeypatch.setattr(app.lifespan, "check_schema", no_schema)
    started: list[Notebook] = []
    with pytest.raises(StartupError, match="schema is behind"):
        async with app_factory(packs=[notes_pack(started)]):
            pass
    assert len(started) == 1 and started[0].closed


async def test_a_misspelt_setting_given_in_code_is_refused(app_factory: AppFactory) -> None:
    with pytest.raises(StartupError, match="unknown settings greting"):
        async with app_factory(packs=[notes_pack([])], pack_settings={"notes": {"greting": "hi"}}):
            pass


async def test_settings_for_a_pack_that_is_not_served_are_refused(app_factory: AppFactory) -> None:
    with pytest.raises(StartupError, match="not enabled: retial"):
        async with app_factory(pack_settings={"retial": {"data": "/tmp"}}):
            pass


def test_a_pack_settings_model_must_read_the_packs_own_prefix() -> None:
    class Elsewhere(PackSettings):
        model_config = pack_settings_config("other")
        value: int = 1

    with pytest.raises(ToolDefinitionError, match="SPARRING_MINE_"):
        Pack("mine", settings=Elsewhere)


def test_resources_of_another_kind_are_a_clear_error() -> None:
    view = RolloutView(
        trace_id=None,
        item={},
        sample={},
        final_answer="",
        calls=[],
        state=RolloutState({}, {}, writable=False),
    )
    with pytest.raises(ToolDefinitionError, match="resources to be a Notebook, got NoneType"):
        view.resource(Notebook)


@pytest.mark.parametrize(
    ("module", "source", "reason"),
    [
        ("nodoc", "@pack.tool\ndef nodoc(x: int) -> int:\n    return x\n", "tool 'nodoc' needs a docstring"),
        ("syntax", "@pack.tool\ndef broken(x: int) -> int\n", "invalid syntax|expected ':'"),
    ],
)
def test_a_pack_module_that_fails_to_import_stops_the_server_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str, reason: str
) -> None:
    """A mistake in a pack's own code (a tool the SDK refuses, a syntax error) is the one line naming the
    pack and the mistake, as an unknown pack is: never a traceback of the import."""
    package = tmp_path / f"badpacks_{module}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tools.py").write_text(f"from app.sdk import Pack\n\npack = Pack('bad')\n\n{source}")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"badpacks_{module}.tools"
    with pytest.raises(PackLoadError, match=f"pack '{name}' cannot be imported: .*({reason})"):
        Registry.from_names([name])  # what `sparring serve` and the app's start-up load
