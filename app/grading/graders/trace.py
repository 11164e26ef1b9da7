"""Trace-aware graders: they score what the server recorded for the rollout, not only the final answer.

Which calls count: the platform retries a call we failed (tool_crash answers 500, infra_error 503), so
budgets and loops count only the calls the model got an answer to (outcome ok or model_error); a
required tool counts as used only when a call to it succeeded (ok); a forbidden tool is violated by
any attempt. With no rollout (no trace_id, or the server saw no call) each grader gives the score
its definition gives for zero calls, never an error:

- tool_budget: 1 while answered calls <= max_calls, then decay ** (calls - max_calls), so with the
  default decay 0.8 one call over scores 0.8, two 0.64, five 0.33, ten 0.11 (decay 0: a hard cut).
  No calls: 1.
- no_loops: the share of answered calls that do not repeat an earlier call with the same tool and
  the same arguments (beyond `allowed_repeats`; with `same_output_only`, only repeats that also got
  the same output, i.e. learned nothing new). No calls: 1.
- grounded: the share of the answer's numbers and quoted strings (the first 200 of each kind, those
  looked for) that appear in some tool output (or, with `include_prompt`, in the item's messages).
  An answer with nothing checkable scores 1 when some call was answered, and 0 when none was (a guess
  made without looking: an empty answer scores 1, claiming nothing); with no calls, checkable claims
  not in the prompt are ungrounded.
- required_tools: the share of the listed tools called successfully at least once. No calls: 0.
- forbidden_tools: 0 if any listed tool was called at all, else 1. No calls: 1.
- state_check: the pack's check on a read-only view of the final state. No calls: the check's verdict
  on the pack's untouched state (the retail check gives 0 and a flag).
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import orjson

from app.grading.graders.model import (
    GradeInput,
    GradeResult,
    GraderUnavailable,
    RolloutCall,
    RolloutRecord,
    RolloutStateLost,
    final_answer,
)
from app.grading.graders.templates import Scope, Template
from app.grounding import checked_claims, prompt_texts
from app.rollouts.store import CONVERSATIONS
from app.sdk import (
    CallView,
    CheckResult,
    GradingConfigError,
    Pack,
    RolloutState,
    RolloutView,
    StateCheck,
    StateGone,
    ToolUnavailable,
)
from sparring.wire import ANSWERS

# The same names as the review flags (app/review/flags.py), so a grader's flag and a review flag agree.
OVER_BUDGET = "over_budget"
REPEATED_CALL = "repeated_call"
UNGROUNDED_ANSWER = "ungrounded_answer"
MISSING_REQUIRED_TOOL = "missing_required_tool"
FORBIDDEN_TOOL = "forbidden_tool"
STATE_CHECK_FAILED = "state_check_failed"

ANSWERED = frozenset(ANSWERS)  # as the review flags (app/grading/flags.py)
MAX_LISTED = 5

PackStateFactory = Callable[[str, RolloutRecord | None], RolloutState]


def _calls(inp: GradeInput) -> Sequence[RolloutCall]:
    return inp.rollout.calls if inp.rollout is not None else ()


def answered_calls(inp: GradeInput) -> list[RolloutCall]:
    return [c for c in _calls(inp) if c.outcome in ANSWERED]


def canonical_arguments(arguments: Any) -> str:
    """Arguments in a form where `{"a": 1, "b": 2}` and `{"b":2,"a":1}` (even as text) are equal."""
    if isinstance(arguments, str):
        text = arguments.strip()
        try:
            arguments = orjson.loads(text) if text else {}
        except orjson.JSONDecodeError:
            return text
    try:
        return orjson.dumps(
            arguments, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str
        ).decode()
    except TypeError:
        return repr(arguments)


def _listed(values: Iterable[str]) -> str:
    values = list(values)
    shown = ", ".join(repr(v) for v in values[:MAX_LISTED])
    return shown + (f" and {len(values) - MAX_LISTED} more" if len(values) > MAX_LISTED else "")


class _TraceGrader:
    needs_rollout = True

    def __init__(self, *, name: str, version: str) -> None:
        self.name = name
        self.version = version


class ToolBudgetGrader(_TraceGrader):
    def __init__(self, *, max_calls: int, decay: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_calls = max_calls
        self.decay = decay

    async def grade(self, inp: GradeInput) -> GradeResult:
        count = len(answered_calls(inp))
        over = count - self.max_calls
        if over <= 0:
            return GradeResult(score=1.0)
        return GradeResult(
            score=self.decay**over,
            flags=[(OVER_BUDGET, f"{count} tool calls, {over} over the budget of {self.max_calls}")],
        )


class NoLoopsGrader(_TraceGrader):
    def __init__(self, *, allowed_repeats: int, same_output_only: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allowed_repeats = allowed_repeats
        self.same_output_only = same_output_only

    async def grade(self, inp: GradeInput) -> GradeResult:
        calls = answered_calls(inp)
        if not calls:
            return GradeResult(score=1.0)
        seen: Counter[tuple[str, ...]] = Counter()
        repeated: Counter[str] = Counter()
        for call in calls:
            key: tuple[str, ...] = (call.tool, canonical_arguments(call.arguments))
            if self.same_output_only:
                key += (call.output or "",)
            seen[key] += 1
            if seen[key] > 1 + self.allowed_repeats:
                repeated[call.tool] += 1
        repeats = sum(repeated.values())
        if not repeats:
            return GradeResult(score=1.0)
        described = ", ".join(f"{tool} ×{n}" for tool, n in repeated.most_common(MAX_LISTED))
        return GradeResult(
            score=(len(calls) - repeats) / len(calls),
            flags=[
                (
                    REPEATED_CALL,
                    f"{repeats} of {len(calls)} calls repeat an identical earlier call: {described}",
                )
            ],
        )


class RequiredToolsGrader(_TraceGrader):
    def __init__(self, *, tools: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tools = list(dict.fromkeys(tools))

    async def grade(self, inp: GradeInput) -> GradeResult:
        used = {c.tool for c in _calls(inp) if c.outcome == "ok"}
        missing = [t for t in self.tools if t not in used]
        score = (len(self.tools) - len(missing)) / len(self.tools)
        flags = [(MISSING_REQUIRED_TOOL, f"never called successfully: {_listed(missing)}")] if missing else []
        return GradeResult(score=score, flags=flags)


class ForbiddenToolsGrader(_TraceGrader):
    def __init__(self, *, tools: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tools = frozenset(tools)

    async def grade(self, inp: GradeInput) -> GradeResult:
        called = sorted({c.tool for c in _calls(inp)} & self.tools)
        if not called:
            return GradeResult(score=1.0)
        return GradeResult(score=0.0, flags=[(FORBIDDEN_TOOL, f"called forbidden tool(s) {_listed(called)}")])


class GroundedGrader(_TraceGrader):
    def __init__(
        self, *, input: Template | None, include_prompt: bool, ignore_numbers_below: float, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.input = input
        self.include_prompt = include_prompt
        self.ignore_numbers_below = ignore_numbers_below

    async def grade(self, inp: GradeInput) -> GradeResult:
        answer = self.input.render(Scope.of(inp)) if self.input is not None else final_answer(inp.sample)
        outputs = [c.output for c in _calls(inp) if c.output]
        sources = outputs + (prompt_texts(inp.item) if self.include_prompt else [])
        made, checked, missing = checked_claims(answer, sources, self.ignore_numbers_below)
        if not made and not outputs and answer.strip():
            # Nothing checkable in the answer, and no tool output it could rest on: a claim made without
            # looking (a one-word guess of the reference) is not grounded.
            return GradeResult(
                score=0.0,
                flags=[(UNGROUNDED_ANSWER, "the answer rests on no tool output: no call was answered")],
            )
        if not missing:  # everything grounded, or nothing to ground
            return GradeResult(score=1.0)
        return GradeResult(
            score=(checked - len(missing)) / checked,  # of the claims looked for, not of those made
            flags=[(UNGROUNDED_ANSWER, f"the answer states {_listed(missing)}, found in no tool output")],
        )


# --- pack state checks -----------------------------------------------------------------------------------


def pack_state(pack: Pack, rollout: RolloutRecord | None) -> RolloutState:
    """The read-only state of `pack` at the end of the rollout: its base with the rollout's changes."""
    changes = rollout.state.get(pack.name, {}) if rollout is not None else {}
    return RolloutState(pack.base(), {c: dict(records) for c, records in changes.items()}, writable=False)


def with_user_end(sample: Mapping[str, Any], pack: str, rollout: RolloutRecord | None) -> Mapping[str, Any]:
    """`sample` with `ended_by` (how the conversation with the simulated user ended, as the loop's sample
    has it) when the rollout's own conversation through `send_message_to_user` has ended and the
    sample does not say: a tool-only loop's platform sends no `ended_by`, and τ² rewards a
    conversation cut short (max_steps, too_many_errors) 0."""
    if "ended_by" in sample or rollout is None:
        return sample
    conversation = rollout.state.get(CONVERSATIONS, {}).get(pack, {}).get("conversation")
    ended = conversation.get("ended") if isinstance(conversation, Mapping) else None
    return {**sample, "ended_by": ended} if ended else sample


def call_views(rollout: RolloutRecord | None) -> list[CallView]:
    if rollout is None:
        return []
    return [
        CallView(tool=c.tool, arguments=c.parsed_arguments(), output=c.output or "", outcome=c.outcome)
        for c in rollout.calls
    ]


class StateCheckGrader(_TraceGrader):
    """Serves a pack's state check: its CheckResult's score, sub-scores and flags become the grade."""

    def __init__(
        self, *, check_name: str, pack: Pack, check: StateCheck, make_state: PackStateFactory, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.check_name = check_name
        self.pack = pack
        self.check = check
        self.make_state = make_state

    async def grade(self, inp: GradeInput) -> GradeResult:
        if inp.rollout is not None:
            inp.rollout.require_state()
        view = RolloutView(
            trace_id=inp.trace_id,
            item=inp.item,
            sample=with_user_end(inp.sample, self.pack.name, inp.rollout),
            final_answer=final_answer(inp.sample),
            calls=call_views(inp.rollout),
            state=self.make_state(self.pack.name, inp.rollout),
        )
        try:
            if inspect.iscoroutinefunction(self.check):
                outcome: Any = await self.check(view)
            else:
                # A check may replay a whole gold trajectory: keep that CPU work off the event loop.
                outcome = await asyncio.to_thread(self.check, view)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
        except (GraderUnavailable, GradingConfigError):
            raise
        except StateGone as exc:
            # What the check reads of the rollout is gone (its live interpreter): refused, never a 0.
            raise RolloutStateLost(
                inp.trace_id,
                f"state check {self.check_name!r} cannot score rollout {inp.trace_id!r}: {exc.message}",
            ) from exc
        except ToolUnavailable as exc:
            # The pack's infrastructure is down (its sandbox cannot run): no score, the grade is retried.
            raise GraderUnavailable(f"state check {self.check_name!r}: {exc.message}") from exc
        except Exception as exc:
            reason = f"state check {self.check_name!r} raised {type(exc).__name__}: {exc}"[:500]
            return GradeResult.failed(reason, flags=[(STATE_CHECK_FAILED, reason)])
        if not isinstance(outcome, CheckResult) or not isinstance(outcome.score, int | float):
            what = type(outcome.score if isinstance(outcome, CheckResult) else outcome).__name__
            reason = f"state check {self.check_name!r} returned {what}, not a CheckResult with a number"
            return GradeResult.failed(reason, flags=[(STATE_CHECK_FAILED, reason)])
        return GradeResult(
            score=float(outcome.score),  # a bool verdict is 0 or 1
            sub_scores={
                str(k): float(v) for k, v in outcome.sub_scores.items() if isinstance(v, int | float)
            },
            flags=[(str(n), str(r)) for n, r in outcome.flags],
        )
