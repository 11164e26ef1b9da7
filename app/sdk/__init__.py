"""What tool packs import: declare tools, read and write rollout state, report mistakes."""

from app.sdk.checks import CallView, CheckResult, RolloutView, StateCheck
from app.sdk.context import ToolContext
from app.sdk.errors import GradingConfigError, StateGone, ToolDefinitionError, ToolError, ToolUnavailable
from app.sdk.lifecycle import PackSettings, PackStart, env_prefix, pack_settings_config
from app.sdk.state import Base, RolloutState
from app.sdk.tool import Pack, ToolSpec, build_spec
from app.sdk.wheel_data import SOURCE_MARKER, DataLocation, PackData, PackDataError, PinnedWheel

__all__ = [
    "SOURCE_MARKER",
    "Base",
    "CallView",
    "CheckResult",
    "DataLocation",
    "GradingConfigError",
    "Pack",
    "PackData",
    "PackDataError",
    "PackSettings",
    "PackStart",
    "PinnedWheel",
    "RolloutState",
    "RolloutView",
    "StateCheck",
    "StateGone",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolSpec",
    "ToolUnavailable",
    "build_spec",
    "env_prefix",
    "pack_settings_config",
]
