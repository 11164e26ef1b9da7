"""The `string_check` grader: eq, ne, like (input contains reference), ilike (ignoring case) → 0 or 1."""

from __future__ import annotations

from collections.abc import Callable

from app.grading.graders.model import GradeInput, GradeResult
from app.grading.graders.templates import Scope, Template

OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": lambda given, reference: given == reference,
    "ne": lambda given, reference: given != reference,
    "like": lambda given, reference: reference in given,
    "ilike": lambda given, reference: reference.casefold() in given.casefold(),
}


class StringCheckGrader:
    def __init__(
        self, *, name: str, version: str, operation: str, input: Template, reference: Template
    ) -> None:
        self.name = name
        self.version = version
        self.operation = operation
        self.compare = OPERATIONS[operation]
        self.input = input
        self.reference = reference
        self.needs_rollout = input.uses_rollout or reference.uses_rollout

    async def grade(self, inp: GradeInput) -> GradeResult:
        scope = Scope.of(inp)
        matched = self.compare(self.input.render(scope), self.reference.render(scope))
        return GradeResult(score=1.0 if matched else 0.0)
