"""What a tool receives when it declares a `ToolContext` parameter."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.sdk.lifecycle import resource_as
from app.sdk.state import RolloutState

T = TypeVar("T")


@dataclass
class ToolContext:
    trace_id: str
    call_id: str | None
    tool_name: str
    item: dict[str, Any]
    state: RolloutState
    logger: logging.LoggerAdapter[logging.Logger]
    deadline: float = field(default_factory=lambda: time.monotonic() + 300.0)
    run: str | None = None
    # What the pack's lifespan yielded for this app (None for a pack without one).
    resources: object = None
    # The call named no trace_id: its rollout (`trace_anon_<hex>`) is its own, and no later call reaches
    # it, so whatever a tool keeps for it beyond the call (a live interpreter) is let go at its end.
    anonymous: bool = False

    def resource(self, kind: type[T]) -> T:
        """The pack's resources, typed: `ctx.resource(CodeResources).sandbox`."""
        return resource_as(self.resources, kind, user=f"tool {self.tool_name!r}")

    def remaining(self) -> float:
        """Seconds left before the call's deadline."""
        return max(0.0, self.deadline - time.monotonic())
