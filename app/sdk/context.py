"""What a tool receives when it declares a `ToolContext` parameter."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from app.sdk.state import RolloutState


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

    def remaining(self) -> float:
        """Seconds left before the call's deadline."""
        return max(0.0, self.deadline - time.monotonic())
