"""The registry of enabled tool packs: one source of truth for routes, job configs and datasets."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.sdk import Pack, ToolSpec
from app.sdk.checks import StateCheck


class PackLoadError(RuntimeError):
    pass


@dataclass
class Registry:
    packs: dict[str, Pack] = field(default_factory=dict)
    tools: dict[str, ToolSpec] = field(default_factory=dict)

    @classmethod
    def from_packs(cls, packs: Iterable[Pack]) -> Registry:
        registry = cls()
        for pack in packs:
            if pack.name in registry.packs:
                raise PackLoadError(f"pack {pack.name!r} is enabled twice")
            registry.packs[pack.name] = pack
            for name, spec in pack.tools.items():
                if name in registry.tools:
                    other = registry.tools[name].pack
                    raise PackLoadError(
                        f"tool {name!r} is defined by both pack {other!r} and pack {pack.name!r}"
                    )
                registry.tools[name] = spec
        return registry

    @classmethod
    def from_names(cls, names: Iterable[str]) -> Registry:
        return cls.from_packs(load_pack(name) for name in names)

    @property
    def state_checks(self) -> Mapping[str, tuple[Pack, StateCheck]]:
        return {
            name: (pack, check) for pack in self.packs.values() for name, check in pack.state_checks.items()
        }

    def dataset_tools(self) -> list[dict[str, Any]]:
        """The `tools` array of a dataset line (chat-completions function tools)."""
        return [spec.function_tool() for spec in self.tools.values()]


def load_pack(name: str) -> Pack:
    """Import `tools.<name>` (or a dotted module path) and return its `pack`."""
    module_name = name if "." in name else f"tools.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise PackLoadError(f"pack {name!r} not found (no module {module_name!r})") from exc
    pack = getattr(module, "pack", None)
    if not isinstance(pack, Pack):
        raise PackLoadError(f"module {module_name!r} has no `pack` (an app.sdk.Pack)")
    return pack
