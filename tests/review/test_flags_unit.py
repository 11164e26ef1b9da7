"""The flag checks as pure functions: each fires on its pattern, with its evidence, and not otherwise."""

from __future__ import annotations

from app.grading.flags import (
    FLAG_NAMES,
    FlagPolicy,
    answer_hash,
    compute_flags,
    final_answer,
    normalize_answer,
    ungrounded_values,
)
from app.review.flag_help import FLAG_HELP, flag_help
from tests.grading.records import rollout_call as call


def names(flags: list) -> list[str]:  # type: ignore[type-arg]
    return [f.name for f in flags]


def test_normalized_answers_hash_alike() -> None:
    assert normalize_answer("  The  Refund\nis DONE. ") == "the refund is done"
    assert answer_hash("The refund is done.") == answer_hash("the refund   is done")
    assert answer_hash("the refund is done") != answer_hash("the refund is not done")
    assert len(answer_hash("x")) == 64


def test_final_answer_reads_output_text_or_the_last_choice() -> None:
    assert final_answer({"output_text": "hi"}) == "hi"
    assert final_answer({"choices": [{"message": {"content": "a"}}, {"message": {"content": "b"}}]}) == "b"
    assert final_answer({}) == ""


def test_grounding_checks_numbers_and_quotes_against_outputs() -> None:
    outputs = ['{"total": 1234.5, "name": "Blue Widget", "qty": 3}']
    assert ungrounded_values('Your total is $1,234.50 for the "Blue Widget".', outputs) == []
    assert ungrounded_values('Total 1234.50 and order 9917, item "Red Gadget"', outputs) == [
        "9917",
        "Red Gadget",
    ]
    # Small counts are the model's own arithmetic, apostrophes are not quotes.
    assert ungrounded_values("You have 3 items and it's fine, don't worry", outputs) == []
    # Non-ASCII and escaped JSON strings are compared decoded.
    assert ungrounded_values('Ship to "Zürich"', ['{"city": "Z\\u00fcrich"}']) == []


def test_a_clean_rollout_raises_nothing() -> None:
    calls = [call(0, output='{"value": 100}'), call(1, tool="other", arguments='{"a": 1}')]
    assert compute_flags(calls, answer="The value is 100.", score=1.0, status="ok") == []


def test_high_score_without_calls() -> None:
    assert names(compute_flags([], answer="Paris", score=0.95, status="ok")) == ["high_score_no_calls"]
    assert compute_flags([], answer="Paris", score=0.2, status="ok") == []
    # Without a trace the calls are unknown: no call-based flag.
    assert compute_flags(None, answer="Paris", score=1.0, status="ok") == []


def test_repeated_calls_ignore_key_order_and_environment_failures() -> None:
    calls = [
        call(0, arguments='{"a": 1, "b": 2}'),
        call(1, arguments={"b": 2, "a": 1}),
        call(2, arguments='{"a":1,"b":2}', outcome="model_error"),
        call(3, arguments='{"a": 1, "b": 3}'),
    ]
    (flag,) = compute_flags(calls, answer="ok", score=0.0, status="ok")
    assert flag.name == "repeated_call" and flag.evidence == [0, 1, 2]
    assert "lookup ×3" in flag.reason
    retried = [call(0, outcome="infra_error"), call(1, outcome="infra_error"), call(2)]
    assert "repeated_call" not in names(compute_flags(retried, answer="", score=0.0, status="ok"))


def test_over_budget_cites_the_calls_past_it() -> None:
    calls = [call(i, arguments=f'{{"i": {i}}}') for i in range(6)]
    (flag,) = compute_flags(calls, answer="done", score=0.0, status="ok", policy=FlagPolicy(call_budget=4))
    assert flag.name == "over_budget" and flag.evidence == [4, 5]
    assert compute_flags(calls, answer="done", score=0.0, status="ok", policy=FlagPolicy(call_budget=6)) == []


def test_empty_answer_with_high_score() -> None:
    calls = [call(0)]
    assert names(compute_flags(calls, answer=" . ", score=0.9, status="ok")) == ["empty_answer_high_score"]
    assert compute_flags(calls, answer="", score=0.1, status="ok") == []
    assert compute_flags(calls, answer="ok", score=0.9, status="ok") == []


def test_identical_answer_needs_other_items_and_a_real_answer() -> None:
    answer = "I have processed your refund request."
    (flag,) = compute_flags([call(0)], answer=answer, score=0.0, status="ok", same_answer_items=3)
    assert flag.name == "identical_answer_across_items" and "3 other items" in flag.reason
    assert compute_flags([call(0)], answer=answer, score=0.0, status="ok", same_answer_items=0) == []
    assert compute_flags([call(0)], answer="yes", score=0.0, status="ok", same_answer_items=9) == []


def test_tool_errors_and_failed_grades() -> None:
    calls = [call(0), call(1, outcome="tool_crash", output=""), call(2, outcome="infra_error", output="")]
    flags = compute_flags(calls, answer="", score=None, status="failed", errors=["judge timed out"])
    assert names(flags) == ["grade_failed", "tool_errors"]
    assert flags[0].reason == "the grader failed: judge timed out"
    assert flags[1].evidence == [1, 2] and "infra_error ×1, tool_crash ×1" in flags[1].reason


def test_every_review_flag_has_its_own_legend_line_and_none_is_said_to_come_from_the_grader() -> None:
    assert set(FLAG_HELP) == set(FLAG_NAMES)
    generic = flag_help("a-grader-s-own-flag")
    assert all(flag_help(name) != generic for name in FLAG_NAMES)
    assert "server" in flag_help("call_id_reused") and "grader itself" not in flag_help("call_id_reused")
