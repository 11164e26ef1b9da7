"""What tool packs import: declare tools, read and write rollout state, report mistakes."""

from app.sdk.checks import CallView, CheckResult, RolloutView, StateCheck
from app.sdk.context import ToolContext
from app.sdk.errors import GradingConfigError, ToolDefinitionError, ToolError, ToolUnavailable
from app.sdk.state import Base, RolloutState
from app.sdk.tool import Pack, ToolSpec, build_spec
from app.sdk.wheel_data import SOURCE_MARKER, PackDataError, PinnedWheel

__all__ = [
    "SOURCE_MARKER",
    "Base",
    "CallView",
    "CheckResult",
    "GradingConfigError",
    "Pack",
    "PackDataError",
    "PinnedWheel",
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
