"""The registry of enabled tool packs (source of truth for routes, job configs, datasets); their start."""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from app.config import load_pack_settings
from app.errors import StartupError
from app.sdk import Pack, PackStart, ToolSpec
from app.sdk.checks import StateCheck

log = logging.getLogger("sparring")

PackOverrides = Mapping[str, Mapping[str, Any]]


class PackLoadError(RuntimeError):
    pass


@dataclass
class Registry:
    packs: dict[str, Pack] = field(default_factory=dict)
    # The tools served at POST /tools/<name>: every name exactly one enabled pack has.
    tools: dict[str, ToolSpec] = field(default_factory=dict)
    # Every tool of each pack, served at POST /packs/<pack>/tools/<name>.
    pack_tools: dict[str, dict[str, ToolSpec]] = field(default_factory=dict)
    # Names several enabled packs have (retail's and airline's `calculate`): the packs, in order. They are
    # served only at their packs' qualified routes.
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The simulated user's tools of each pack that has some, served at POST /user-tools/<name>.
    user_tools: dict[str, dict[str, ToolSpec]] = field(default_factory=dict)
    # What each started pack's lifespan yielded, by pack name (None before start-up).
    resources: dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_packs(cls, packs: Iterable[Pack]) -> Registry:
        registry = cls()
        for pack in packs:
            if pack.name in registry.packs:
                raise PackLoadError(f"pack {pack.name!r} is enabled twice")
            registry.packs[pack.name] = pack
            registry.resources[pack.name] = pack.resources
            registry.pack_tools[pack.name] = pack.tools
            if pack.user_tools:
                registry.user_tools[pack.name] = pack.user_tools
        registry.index()
        return registry

    def index(self) -> None:
        """`tools` and `shared` from `pack_tools` (again, after a tool was added to a pack's)."""
        owners: dict[str, list[str]] = {}
        for pack, tools in self.pack_tools.items():
            for name in tools:
                owners.setdefault(name, []).append(pack)
        self.tools, self.shared = {}, {}
        for name, names in owners.items():
            if len(names) == 1:
                self.tools[name] = self.pack_tools[names[0]][name]
            else:
                self.shared[name] = tuple(names)

    def qualified_routes(self, name: str) -> list[str]:
        """`POST /packs/<pack>/tools/<name>` of every enabled pack that has a tool `name`."""
        packs = [pack for pack, tools in self.pack_tools.items() if name in tools]
        return [f"POST /packs/{pack}/tools/{name}" for pack in packs]

    def all_user_tools(self) -> dict[str, ToolSpec]:
        """The user tools served at /user-tools/<name> (the first enabled pack's, where names repeat)."""
        merged: dict[str, ToolSpec] = {}
        for tools in reversed(self.user_tools.values()):
            merged.update(tools)
        return merged

    def served(self, name: str) -> bool:
        """Whether some enabled pack has a tool `name` (at /tools/<name> or only at its pack's route)."""
        return (
            name in self.tools
            or name in self.shared
            or any(name in tools for tools in self.user_tools.values())
        )

    @classmethod
    def from_names(cls, names: Iterable[str]) -> Registry:
        return cls.from_packs(load_pack(name) for name in names)

    @property
    def state_checks(self) -> Mapping[str, tuple[Pack, StateCheck]]:
        return {
            name: (pack, check) for pack in self.packs.values() for name, check in pack.state_checks.items()
        }

    def grader_pack(self, grader: str | None) -> str | None:
        """The pack whose state check the grader `grader` is (retail's `retail`), else None."""
        found = self.state_checks.get(grader) if grader is not None else None
        return found[0].name if found is not None else None

    def dataset_tools(self, pack: str | None = None) -> list[dict[str, Any]]:
        """The `tools` array of a dataset line (chat-completions function tools): one pack's, else the
        tools served at /tools/<name>."""
        tools = self.tools if pack is None else self.pack_tools[pack]
        return [spec.function_tool() for spec in tools.values()]


def available_packs() -> list[str]:
    """The names of the packs shipped under `tools/` (what SPARRING_PACKS may name without a dot)."""
    import pkgutil

    import tools

    return sorted(info.name for info in pkgutil.iter_modules(tools.__path__) if not info.name.startswith("_"))


def load_pack(name: str) -> Pack:
    """Import `tools.<name>` (or a dotted module path) and return its `pack`."""
    module_name = name if "." in name else f"tools.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and not module_name.startswith(exc.name):
            # The pack exists, but something it imports is not installed.
            raise PackLoadError(f"pack {name!r} cannot be imported: {exc}") from exc
        known = ", ".join(available_packs()) or "none"
        raise PackLoadError(
            f"no pack named {name!r} (SPARRING_PACKS): the packs are {known} "
            "(or give a module path, e.g. mypackage.tools)"
        ) from exc
    except Exception as exc:  # the pack's own code: a tool the SDK refuses, a syntax error, ...
        raise PackLoadError(f"pack {name!r} cannot be imported: {type(exc).__name__}: {exc}") from exc
    pack = getattr(module, "pack", None)
    if not isinstance(pack, Pack):
        raise PackLoadError(f"module {module_name!r} has no `pack` (an app.sdk.Pack)")
    return pack


@asynccontextmanager
async def start_pack(
    pack: Pack, *, home: Path, binds_loopback: bool, overrides: Mapping[str, Any] | None = None
) -> AsyncIterator[Pack]:
    """Run `pack`'s lifespan on this event loop, then load its base (in a thread); yield the started pack.

    A pack that cannot start raises StartupError with its reason; its resources are released when
    the block ends, however it ends.
    """
    async with AsyncExitStack() as stack:
        try:
            settings = load_pack_settings(pack.settings_model, overrides)
            start = PackStart(settings=settings, home=home, binds_loopback=binds_loopback)
            resources = await stack.enter_async_context(pack.lifespan(start))
            started = time.perf_counter()
            base = await anyio.to_thread.run_sync(pack.load_base, resources)
        except Exception as exc:
            raise StartupError(f"pack {pack.name!r} cannot start: {exc}") from exc
        log.info("pack %s ready (base state loaded in %.2fs)", pack.name, time.perf_counter() - started)
        yield pack.started(resources, base)


@asynccontextmanager
async def start_packs(
    registry: Registry, *, home: Path, binds_loopback: bool, overrides: PackOverrides | None = None
) -> AsyncIterator[Registry]:
    """Start every pack of `registry` in order; yield the registry of the started packs (their tools,
    base and resources); stop them in reverse order when the block ends."""
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(registry.packs))
    if unknown:
        raise StartupError(f"settings given for packs that are not enabled: {', '.join(unknown)}")
    async with AsyncExitStack() as stack:
        started = [
            await stack.enter_async_context(
                start_pack(pack, home=home, binds_loopback=binds_loopback, overrides=overrides.get(name))
            )
            for name, pack in registry.packs.items()
        ]
        yield Registry.from_packs(started)
