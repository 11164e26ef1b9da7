"""State checks: how a pack grades the effect a rollout had on its own state."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.sdk.lifecycle import resource_as
from app.sdk.state import RolloutState

T = TypeVar("T")


@dataclass(frozen=True)
class CallView:
    """One recorded tool call of the rollout, in the order the server started them."""

    tool: str
    arguments: Any
    output: str
    outcome: str  # ok | model_error | tool_crash | infra_error
    call_id: str | None = None


@dataclass(frozen=True)
class RolloutView:
    """What a state check sees: the dataset row, the model's answer, its calls and the pack's final state."""

    trace_id: str | None
    item: Mapping[str, Any]
    sample: Mapping[str, Any]
    final_answer: str
    calls: Sequence[CallView]
    state: RolloutState  # read-only: the pack's base with this rollout's changes
    resources: object = None  # what the pack's lifespan yielded for this app

    def resource(self, kind: type[T]) -> T:
        """The pack's resources, typed: `view.resource(CodeResources).sandbox`."""
        return resource_as(self.resources, kind, user="a state check")


@dataclass(frozen=True)
class CheckResult:
    score: float
    sub_scores: Mapping[str, float] = field(default_factory=dict)
    # Flags a reviewer should see, e.g. ("no_tool_calls", "the rollout made no call").
    flags: Sequence[tuple[str, str]] = ()


StateCheck = Callable[[RolloutView], CheckResult | Awaitable[CheckResult]]
