"""What tool packs import: declare tools, read and write rollout state, report mistakes."""

from app.sdk.checks import CallView, CheckResult, RolloutView, StateCheck
from app.sdk.context import ToolContext
from app.sdk.errors import GradingConfigError, ToolDefinitionError, ToolError, ToolUnavailable
from app.sdk.state import Base, RolloutState
from app.sdk.tool import Pack, ToolSpec, build_spec

__all__ = [
    "Base",
    "CallView",
    "CheckResult",
    "GradingConfigError",
    "Pack",
    "RolloutState",
    "RolloutView",
    "StateCheck",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolSpec",
    "ToolUnavailable",
    "build_spec",
]
