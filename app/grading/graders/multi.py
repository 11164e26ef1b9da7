"""The `multi` grader: sub-graders run concurrently, combined by the `calculate_output` formula.

Each sub-grader's score is kept under its key in `sub_scores` (and its own sub-scores under
`key.sub`); its errors and flags are kept, prefixed by the key. A formula that cannot be evaluated on
these scores (division by zero, log of 0...) gives 0 with the reason recorded. If any sub-grader's
infrastructure is down the whole grade is (GraderUnavailable): a partial score would be a fake one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from app.grading.graders.formula import Formula, FormulaRuntimeError
from app.grading.graders.model import GradeInput, Grader, GradeResult


class MultiGrader:
    def __init__(self, *, name: str, version: str, graders: Mapping[str, Grader], formula: Formula) -> None:
        self.name = name
        self.version = version
        self.graders = dict(graders)
        self.formula = formula
        self.needs_rollout = any(g.needs_rollout for g in self.graders.values())

    async def grade(self, inp: GradeInput) -> GradeResult:
        results = await _grade_all(self.graders, inp)
        sub_scores: dict[str, float] = {}
        errors: list[str] = []
        flags: list[tuple[str, str]] = []
        for key, result in results.items():
            sub_scores[key] = result.score
            for sub, value in result.sub_scores.items():
                sub_scores[f"{key}.{sub}"] = value
            errors.extend(f"{key}: {error}" for error in result.errors)
            flags.extend(result.flags)
        try:
            score = self.formula.evaluate({key: r.score for key, r in results.items()})
        except FormulaRuntimeError as exc:
            errors.append(f"calculate_output: {exc}")
            score = 0.0
        return GradeResult(score=score, sub_scores=sub_scores, errors=errors, flags=flags)


async def _grade_all(graders: Mapping[str, Grader], inp: GradeInput) -> dict[str, GradeResult]:
    try:
        async with asyncio.TaskGroup() as group:
            tasks = {key: group.create_task(grader.grade(inp)) for key, grader in graders.items()}
    except BaseExceptionGroup as failures:
        # The siblings are cancelled already; surface the first real failure as itself.
        raise failures.exceptions[0] from None
    return {key: task.result() for key, task in tasks.items()}
