"""The `airline` grader: τ²-bench's reward on the task's reward basis; a rollout without calls a flag only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from app.sdk import CallView, CheckResult, RolloutView
from tests.airline import corpus, reference
from tools.airline import dataset, pack
from tools.airline.check import NO_TOOL_CALLS, AirlineItemError, check_rollout, gold_changes
from tools.airline.tasks import ToolCall
from tools.retail.check import PREMATURE_END
from tools.retail.tasks import Replay


def grade(
    result: Replay, item: Mapping[str, Any], answer: str, *, ended_by: str | None = None
) -> CheckResult:
    views = [
        CallView(tool=r.tool, arguments=r.arguments, output="", outcome="model_error" if r.error else "ok")
        for r in result.results
    ]
    view = RolloutView(
        trace_id="trace_test",
        item=item,
        sample={"output_text": answer} if ended_by is None else {"output_text": answer, "ended_by": ended_by},
        final_answer=answer,
        calls=views,
        state=result.state(corpus.store()),
        resources=corpus.RESOURCES,
    )
    return check_rollout(view)


def last_successful_write(result: Replay) -> int | None:
    writes = [
        i for i, call in enumerate(result.results) if pack.tools[call.tool].mutates and call.error is None
    ]
    return writes[-1] if writes else None


@pytest.mark.parametrize("split", ["train", "test"])
def test_replaying_each_tasks_gold_calls_scores_1(split: str) -> None:
    failures = []
    for task_id in corpus.split_task_ids(split):  # type: ignore[arg-type]
        calls = corpus.gold_calls(task_id)
        graded = grade(corpus.replay(calls), {"task_id": task_id}, corpus.answer_for(task_id))
        expected_flags = [] if calls else [NO_TOOL_CALLS]
        if graded.score != 1.0 or [name for name, _ in graded.flags] != expected_flags:
            failures.append((task_id, graded))
    assert failures == []


def test_dropping_the_last_write_scores_0() -> None:
    checked, failures = 0, []
    for task_id in corpus.load_tasks():
        calls = corpus.gold_calls(task_id)
        cut = last_successful_write(corpus.replay(calls))
        if cut is None:
            continue
        checked += 1
        graded = grade(
            corpus.replay(calls[:cut] + calls[cut + 1 :]), {"task_id": task_id}, corpus.answer_for(task_id)
        )
        if graded.sub_scores["db"] != 0.0 or graded.score != 0.0:
            failures.append(task_id)
    assert failures == []
    assert checked >= 30


def test_a_rollout_without_calls_gets_the_references_reward_and_a_flag() -> None:
    # Task 26 (test split) asks for nothing to change and nothing to be told: τ²-bench rewards a
    # conversation that did exactly that, calls or not. The retail grader would give it 0.
    assert corpus.gold_calls("26") == []
    answer = "I am sorry, I cannot do that."
    graded = grade(corpus.replay([]), {"task_id": "26"}, answer)
    assert graded.score == reference.reward("26", [], [], answer) == 1.0
    assert [name for name, _ in graded.flags] == [NO_TOOL_CALLS]
    # A task that needs a write still scores 0 without it, flag or not.
    assert (
        grade(corpus.replay([]), {"task_id": "19"}, answer).score
        == reference.reward("19", [], [], answer)
        == 0.0
    )


@pytest.mark.parametrize("ended_by", ["max_steps", "too_many_errors", "user_stop", "user_transfer"])
def test_a_conversation_cut_short_scores_0_with_a_flag_one_the_user_ended_as_before(ended_by: str) -> None:
    # τ²-bench's evaluate_simulation rewards a simulation that ended by MAX_STEPS or TOO_MANY_ERRORS 0
    # ("terminated prematurely"); the user's stop tokens are its USER_STOP, graded as usual.
    calls: list[ToolCall] = corpus.gold_calls("18")
    answer = "Done. " + " and ".join(corpus.get_task("18").evaluation_criteria.communicate_info)
    graded = grade(corpus.replay(calls), {"task_id": "18"}, answer, ended_by=ended_by)
    if ended_by in ("max_steps", "too_many_errors"):
        assert graded.score == 0.0 and graded.sub_scores == {"db": 1.0, "communicate": 1.0}
        ((name, reason),) = graded.flags
        assert name == PREMATURE_END and ended_by in reason
    else:
        assert graded.score == 1.0 and not graded.flags


def test_missing_facts_fail_the_communicate_check() -> None:
    calls: list[ToolCall] = corpus.gold_calls("18")
    result = corpus.replay(calls)
    assert corpus.get_task("18").evaluation_criteria.communicate_info == ["23553"]
    partial = grade(result, {"task_id": "18"}, "Your reservations are updated.")
    assert partial.sub_scores == {"db": 1.0, "communicate": 0.0} and partial.score == 0.0
    full = grade(result, {"task_id": "18"}, "The total is $23,553.")  # commas ignored, as in τ²-bench
    assert full.score == 1.0
    outputs = corpus.outputs(result)
    assert reference.reward("18", calls, outputs, "The total is $23,553.") == 1.0
    assert reference.reward("18", calls, outputs, "Your reservations are updated.") == 0.0


def test_an_extra_write_fails_the_database_check() -> None:
    calls = [*corpus.gold_calls("19"), ("send_certificate", {"user_id": "mei_hernandez_8984", "amount": 100})]
    graded = grade(corpus.replay(calls), {"task_id": "19"}, "")
    assert graded.sub_scores == {"db": 0.0, "communicate": 1.0} and graded.score == 0.0


def test_the_dataset_lines_fields_grade_like_the_task() -> None:
    line = next(line for line in dataset.build_dataset(corpus.DATA_DIR, "test") if line["task_id"] == "18")
    item = {key: value for key, value in line.items() if key not in ("messages", "tools")}
    assert item["reward_basis"] == ["DB", "COMMUNICATE"]
    result = corpus.replay(corpus.gold_calls("18"))
    assert grade(result, item, "23553").score == 1.0
    # The row's own fields are used: a row whose gold says "change nothing" fails this rollout's database,
    # and a row whose basis is the database alone does not ask for the fact.
    assert grade(result, {**item, "actions": []}, "23553").sub_scores["db"] == 0.0
    assert grade(result, {**item, "reward_basis": ["DB"]}, "").score == 1.0


def test_a_row_the_grader_cannot_use_is_an_error_not_a_score() -> None:
    with pytest.raises(AirlineItemError, match="task_id"):
        grade(corpus.replay([]), {}, "")
    with pytest.raises(AirlineItemError, match="'nope'"):
        grade(corpus.replay([]), {"task_id": "nope"}, "")
    with pytest.raises(AirlineItemError, match=r"item\.actions"):
        grade(corpus.replay([]), {"actions": [{"arguments": {}}]}, "")
    with pytest.raises(AirlineItemError, match="NL_ASSERTION"):
        grade(corpus.replay([]), {"task_id": "0", "reward_basis": ["DB", "NL_ASSERTION"]}, "")


def test_the_gold_database_is_computed_once_per_task() -> None:
    calls = corpus.gold_calls("23")
    assert gold_changes(calls, corpus.DATA_DIR) is gold_changes(calls, corpus.DATA_DIR)
    # Task 23 books three reservations: the reference's three new ids, in order.
    assert {"HATHAT", "HATHAU", "HATHAV"} <= set(gold_changes(calls, corpus.DATA_DIR)["reservations"])
