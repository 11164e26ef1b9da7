"""What a grader is given, what it answers, and the two ways grading can fail."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from app.grounding import final_answer
from app.rollouts.shapes import RolloutCall

__all__ = [
    "GradeInput",
    "GradeResult",
    "Grader",
    "GraderConfigError",
    "GraderUnavailable",
    "RolloutCall",
    "RolloutRecord",
    "final_answer",
]


@dataclass(frozen=True)
class RolloutRecord:
    """Everything the server recorded for one trace_id."""

    trace_id: str
    calls: Sequence[RolloutCall]  # the one logged-call shape (app/rollouts/shapes.py)
    first_seen: datetime | None
    last_seen: datetime | None
    # {pack: {collection: {key: record}}}; only collections the rollout changed are guaranteed present.
    state: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    # The rollout made calls but the state store no longer holds it (past the idle TTL, or in memory
    # in a process that restarted): `state` is empty, not the rollout's. Graders that read it refuse.
    state_lost: bool = False

    def require_state(self) -> None:
        """Raise RolloutStateLost unless `state` is what the rollout left."""
        if self.state_lost:
            raise RolloutStateLost(self.trace_id)


class RolloutStateLost(Exception):
    """A grader reads the state of a rollout whose state the store no longer holds.

    Grading the pack's base state instead would store a made-up score: the grade is refused.
    """

    def __init__(self, trace_id: str | None, detail: str | None = None) -> None:
        super().__init__(
            detail
            or f"the state of rollout {trace_id!r} is no longer held by the state store (expired after "
            "SPARRING_STATE_TTL_SECONDS, or lost with the process that kept it in memory); a grader "
            "that reads it cannot score this rollout"
        )
        self.trace_id = trace_id


@dataclass(frozen=True)
class GradeInput:
    sample: Mapping[str, Any]  # may be {}
    item: Mapping[str, Any]  # may be {}
    trace_id: str | None
    rollout: RolloutRecord | None  # None when there is no trace_id or the server saw no call


@dataclass
class GradeResult:
    """A grade: always a finite score, plus what went into it.

    `errors` are problems that made (part of) the score 0 without being an outage: a python grader that
    raised, a judge answer that was not a number, a division by zero in a multi formula.
    """

    score: float
    sub_scores: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    flags: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The platform needs a finite number; a NaN or infinity from any path becomes a recorded 0.
        if not _finite(self.score):
            self.errors.append(f"non-finite score {self.score!r} replaced by 0")
            self.score = 0.0
        else:
            self.score = float(self.score)
        for key, value in list(self.sub_scores.items()):
            if not _finite(value):
                self.sub_scores[key] = 0.0
                self.errors.append(f"non-finite sub-score {key!r} ({value!r}) replaced by 0")

    @classmethod
    def failed(cls, error: str, **kwargs: Any) -> GradeResult:
        """A zero that records why."""
        return cls(score=0.0, errors=[error], **kwargs)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@runtime_checkable
class Grader(Protocol):
    name: str  # the name it is served under (/grade/{name})
    version: str  # a stable hash of its normalized config: a changed config is a new version
    needs_rollout: bool  # whether grade() reads inp.rollout (so the caller loads it only when needed)

    async def grade(self, inp: GradeInput) -> GradeResult: ...


class GraderUnavailable(Exception):
    """Grading infrastructure failed (judge API down after retries, python pool broken): answer 503.

    A bad model answer is never this: it scores low.
    """


class GraderConfigError(Exception):
    """A grader config that cannot be served, found at start-up; says where and what."""

    def __init__(self, message: str, *, source: str, grader: str, field: str = "") -> None:
        self.source = source
        self.grader = grader
        self.field = field
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.source}: grader {self.grader!r}" if self.grader else self.source
        if self.field:
            where += f", field {self.field!r}"
        return f"{where}: {self.message}"
