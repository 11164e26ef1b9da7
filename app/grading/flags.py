"""Review flags: pure checks, run when a grade is stored, that point a reviewer at a suspicious rollout."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.grounding import answer_hash, final_answer, normalize_answer, ungrounded
from app.rollouts.shapes import RolloutCall
from sparring import wire

# Outcomes a call can have in the log as read (app/db/call_log.py): the model got an answer (ok,
# model_error, or replayed: the ledger's answer, read only when no attempt that ran it stands), or the
# environment failed it (tool_crash: 500, infra_error: 503; the trainer discards or retries).
ANSWERED = frozenset(wire.ANSWERS)
ENVIRONMENT_FAILURES = frozenset(wire.ENVIRONMENT_FAILURES)

HIGH_SCORE_NO_CALLS = "high_score_no_calls"
UNGROUNDED_ANSWER = "ungrounded_answer"
REPEATED_CALL = "repeated_call"
OVER_BUDGET = "over_budget"
EMPTY_ANSWER_HIGH_SCORE = "empty_answer_high_score"
IDENTICAL_ANSWER_ACROSS_ITEMS = "identical_answer_across_items"
TOOL_ERRORS = "tool_errors"
GRADE_FAILED = "grade_failed"
CALL_ID_REUSED = wire.CALL_ID_REUSED  # the flag is named after the outcome it points at

__all__ = ["answer_hash", "final_answer", "normalize_answer"]  # re-exported for the flags' readers

FLAG_NAMES: tuple[str, ...] = (
    HIGH_SCORE_NO_CALLS,
    UNGROUNDED_ANSWER,
    REPEATED_CALL,
    OVER_BUDGET,
    EMPTY_ANSWER_HIGH_SCORE,
    IDENTICAL_ANSWER_ACROSS_ITEMS,
    TOOL_ERRORS,
    GRADE_FAILED,
    CALL_ID_REUSED,
)


@dataclass(frozen=True)
class Flag:
    name: str
    reason: str
    evidence: list[int] = field(default_factory=list)  # seq numbers of the calls that show it

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "reason": self.reason, "evidence": list(self.evidence)}


@dataclass(frozen=True)
class FlagPolicy:
    """Thresholds of the checks; the defaults suit scores in [0, 1]."""

    high_score: float = 0.8  # a score at or above this counts as "high"
    call_budget: int = 20  # more answered calls than this is over budget
    max_identical_calls: int = 2  # the same tool with the same arguments more often than this is a loop
    near_empty_chars: int = 2  # an answer with fewer letters/digits than this is "near-empty"
    min_identical_answer_chars: int = 12  # shorter answers ("yes", "42") legitimately repeat across items
    ignore_numbers_below: int = 10  # small integers are usually counts the model made, not facts it read
    max_listed: int = 5  # ungrounded values named in a reason


DEFAULT_POLICY = FlagPolicy()


# --- grounding (app/grounding.py) ---------------------------------------------------------------------


def ungrounded_values(answer: str, sources: Sequence[str], policy: FlagPolicy = DEFAULT_POLICY) -> list[str]:
    """Numbers and quoted strings of the answer that appear in none of the sources (tool outputs)."""
    return ungrounded(answer, sources, policy.ignore_numbers_below)[1]


# --- the checks ------------------------------------------------------------------------------------------


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            return str(arguments).strip()
    try:
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS, default=str).decode()
    except TypeError:
        return repr(arguments)


def _is_high(score: float | None, policy: FlagPolicy) -> bool:
    return score is not None and score >= policy.high_score


def check_high_score_no_calls(
    calls: Sequence[RolloutCall], score: float | None, policy: FlagPolicy
) -> Flag | None:
    if calls or not _is_high(score, policy):
        return None
    return Flag(HIGH_SCORE_NO_CALLS, f"scored {score:g} without calling any tool")


def check_ungrounded_answer(
    calls: Sequence[RolloutCall], answer: str, extra_sources: Sequence[str], policy: FlagPolicy
) -> Flag | None:
    sources = [c.output for c in calls if c.output] + list(extra_sources)
    missing = ungrounded_values(answer, sources, policy)
    if not missing:
        return None
    listed = ", ".join(repr(v) for v in missing[: policy.max_listed])
    more = f" and {len(missing) - policy.max_listed} more" if len(missing) > policy.max_listed else ""
    return Flag(UNGROUNDED_ANSWER, f"the answer states {listed}{more}, found in no tool output")


def check_repeated_calls(calls: Sequence[RolloutCall], policy: FlagPolicy) -> Flag | None:
    # Only answered calls: a call the environment failed (and the trainer retried) is not a model loop.
    groups: dict[tuple[str, str], list[int]] = {}
    for call in calls:
        if call.outcome in ANSWERED:
            groups.setdefault((call.tool, _canonical_arguments(call.arguments)), []).append(call.seq)
    loops = [(key, seqs) for key, seqs in groups.items() if len(seqs) > policy.max_identical_calls]
    if not loops:
        return None
    loops.sort(key=lambda item: -len(item[1]))
    described = "; ".join(f"{tool} ×{len(seqs)}" for (tool, _), seqs in loops[:3])
    evidence = sorted(seq for _, seqs in loops for seq in seqs)
    return Flag(REPEATED_CALL, f"the same call with the same arguments repeated: {described}", evidence)


def check_over_budget(calls: Sequence[RolloutCall], policy: FlagPolicy) -> Flag | None:
    answered = [c.seq for c in calls if c.outcome in ANSWERED]
    if len(answered) <= policy.call_budget:
        return None
    return Flag(
        OVER_BUDGET,
        f"{len(answered)} tool calls, over the budget of {policy.call_budget}",
        answered[policy.call_budget :],
    )


def check_empty_answer(answer: str, score: float | None, policy: FlagPolicy) -> Flag | None:
    letters = sum(ch.isalnum() for ch in answer)
    if letters >= policy.near_empty_chars or not _is_high(score, policy):
        return None
    shown = repr(answer.strip()[:20]) if answer.strip() else "an empty answer"
    return Flag(EMPTY_ANSWER_HIGH_SCORE, f"scored {score:g} for {shown}")


def check_identical_answer(answer: str, same_answer_items: int, policy: FlagPolicy) -> Flag | None:
    if same_answer_items <= 0 or len(normalize_answer(answer)) < policy.min_identical_answer_chars:
        return None
    items = "item" if same_answer_items == 1 else "items"
    return Flag(
        IDENTICAL_ANSWER_ACROSS_ITEMS, f"the same answer was given for {same_answer_items} other {items}"
    )


def check_tool_errors(calls: Sequence[RolloutCall]) -> Flag | None:
    failed = [c for c in calls if c.outcome in ENVIRONMENT_FAILURES]
    if not failed:
        return None
    by_outcome = Counter(c.outcome for c in failed)
    described = ", ".join(f"{outcome} ×{n}" for outcome, n in sorted(by_outcome.items()))
    return Flag(
        TOOL_ERRORS, f"the environment failed {len(failed)} call(s): {described}", [c.seq for c in failed]
    )


def check_call_id_reused(calls: Sequence[RolloutCall]) -> Flag | None:
    # The outcome app/calls/service.py logs for a call whose call_id had answered a different call.
    reused = [c.seq for c in calls if c.outcome == CALL_ID_REUSED]
    if not reused:
        return None
    return Flag(
        CALL_ID_REUSED,
        f"{len(reused)} call(s) reused a call_id that had answered a different call (answered with an error)",
        reused,
    )


def check_grade_failed(status: str, errors: Sequence[str]) -> Flag | None:
    if status != "failed":
        return None
    detail = f": {str(errors[0])[:200]}" if errors else ""
    return Flag(GRADE_FAILED, f"the grader failed{detail}")


def compute_flags(
    calls: Sequence[RolloutCall] | None,
    *,
    answer: str,
    score: float | None,
    status: str,
    errors: Sequence[str] = (),
    same_answer_items: int = 0,
    extra_sources: Sequence[str] = (),
    policy: FlagPolicy = DEFAULT_POLICY,
) -> list[Flag]:
    """Every review flag of one graded rollout.

    `calls` are the rollout's logged calls in timeline order (None when the grade has no trace: the
    checks that need calls are skipped). `same_answer_items` is how many *other* items got a grade with
    the same answer hash (GradeRepository.items_with_same_answer). `extra_sources` is text besides tool
    outputs that may ground the answer (e.g. the item's prompt).
    """
    found: list[Flag | None] = [check_grade_failed(status, errors)]
    if calls is not None:
        found += [
            check_high_score_no_calls(calls, score, policy),
            check_ungrounded_answer(calls, answer, extra_sources, policy),
            check_repeated_calls(calls, policy),
            check_over_budget(calls, policy),
            check_tool_errors(calls),
            check_call_id_reused(calls),
        ]
    found += [
        check_empty_answer(answer, score, policy),
        check_identical_answer(answer, same_answer_items, policy),
    ]
    return [flag for flag in found if flag is not None]
