"""The `python` grader: the config's `def grade(sample, item)` run in the worker pool.

The source is compiled at start-up so a syntax error is a config error. A grade that raises, returns
something that is not a finite number, runs past the timeout or exhausts its memory scores 0 with the
reason recorded. As an extension, `def grade(sample, item, rollout)` also receives the rollout as the
templates' `rollout` namespace (tool_calls, calls, tools_used, errors, duration_s, parallel_batches,
state).
"""

from __future__ import annotations

import ast
from typing import Any, Protocol

from app.grading.graders.model import GradeInput, GradeResult
from app.grading.graders.python_pool import PythonOutcome
from app.grading.graders.templates import rollout_namespace


class PythonRunner(Protocol):
    async def run(
        self, source: str, sample: Any, item: Any, rollout: Any | None = None, *, with_rollout: bool = False
    ) -> PythonOutcome: ...


class PythonSourceError(ValueError):
    pass


def grade_arity(source: str) -> int:
    """How many arguments the source's `grade` takes: 2, or 3 with the rollout; else PythonSourceError."""
    try:
        tree = ast.parse(source, filename="<grader>")
        compile(tree, "<grader>", "exec")
    except SyntaxError as exc:
        where = f" at line {exc.lineno}" if exc.lineno else ""
        raise PythonSourceError(f"syntax error{where}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise PythonSourceError(f"cannot compile the source: {type(exc).__name__}: {exc}") from None
    arity: int | None = None
    for node in tree.body:
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "grade":
            raise PythonSourceError("grade must be a plain function, not async")
        if isinstance(node, ast.FunctionDef) and node.name == "grade":
            positional = [*node.args.posonlyargs, *node.args.args]
            required = len(positional) - len(node.args.defaults)
            if node.args.vararg is not None:
                arity = 2
            elif len(positional) == 3 or required == 3:
                arity = 3
            elif required <= 2 <= len(positional):
                arity = 2
            else:
                raise PythonSourceError(
                    f"grade takes {len(positional)} argument(s); it must be grade(sample, item) "
                    "or grade(sample, item, rollout)"
                )
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.ImportFrom) and _binds_grade(node):
            arity = 2
    if arity is None:
        raise PythonSourceError("the source must define a top-level function grade(sample, item)")
    return arity


def _binds_grade(node: ast.Assign | ast.AnnAssign | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return any((alias.asname or alias.name) == "grade" for alias in node.names)
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Name) and t.id == "grade" for t in targets)


class PythonGrader:
    def __init__(self, *, name: str, version: str, source: str, runner: PythonRunner) -> None:
        self.name = name
        self.version = version
        self.source = source
        self.runner = runner
        self.with_rollout = grade_arity(source) == 3
        self.needs_rollout = self.with_rollout

    async def grade(self, inp: GradeInput) -> GradeResult:
        if self.with_rollout and inp.rollout is not None:
            inp.rollout.require_state()  # the rollout it is given includes the state
        outcome = await self.runner.run(
            self.source,
            dict(inp.sample),
            dict(inp.item),
            rollout_namespace(inp.rollout) if self.with_rollout else None,
            with_rollout=self.with_rollout,
        )
        if outcome.error is not None or outcome.score is None:
            return GradeResult.failed(f"python grader: {outcome.error or 'no score'}")
        return GradeResult(score=outcome.score)
