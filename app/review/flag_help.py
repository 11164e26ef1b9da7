"""One line per review flag: what it means and why a reviewer should look (page titles and the legend)."""

from __future__ import annotations

from app.grading.flags import (
    CALL_ID_REUSED,
    DEFAULT_POLICY,
    EMPTY_ANSWER_HIGH_SCORE,
    GRADE_FAILED,
    HIGH_SCORE_NO_CALLS,
    IDENTICAL_ANSWER_ACROSS_ITEMS,
    OVER_BUDGET,
    REPEATED_CALL,
    TOOL_ERRORS,
    UNGROUNDED_ANSWER,
)

_P = DEFAULT_POLICY

FLAG_HELP: dict[str, str] = {
    HIGH_SCORE_NO_CALLS: (
        f"Scored ≥ {_P.high_score:g} without calling any tool: the grader may reward a guess or the prompt "
        "leaks the answer."
    ),
    UNGROUNDED_ANSWER: (
        "The final answer states a number or quoted value that no tool output (nor the prompt) contains: "
        "possibly made up."
    ),
    REPEATED_CALL: (
        f"The same tool with the same arguments was answered more than {_P.max_identical_calls} times: "
        "a loop."
    ),
    OVER_BUDGET: f"More than {_P.call_budget} answered tool calls in one rollout.",
    EMPTY_ANSWER_HIGH_SCORE: (
        f"Scored ≥ {_P.high_score:g} for an (almost) empty answer: the grader is probably being gamed."
    ),
    IDENTICAL_ANSWER_ACROSS_ITEMS: (
        "The same answer was graded for other items: a canned answer that does not depend on the item."
    ),
    TOOL_ERRORS: "Calls crashed (500) or met an outage (503): the environment, not the model, failed.",
    GRADE_FAILED: "The grader itself failed on this rollout (see its errors); the rollout has no score.",
    CALL_ID_REUSED: (
        "The server answered a call whose call_id had already answered another tool or other arguments "
        "(outcome call_id_reused, `Error: call_id … was already used for a different call`); the review "
        "raises the flag from the call log: the trainer reuses ids, or the model copies them."
    ),
}


def flag_help(name: str) -> str:
    """The explanation of a review flag (every name of FLAG_NAMES has one); a grader's own flag gets a
    generic line."""
    return FLAG_HELP.get(name, "Raised by the grader itself (see the grade's reason).")
