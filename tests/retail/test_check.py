"""The `retail` grader: gold replays score 1, a missing write or fact 0, a rollout without calls a flag."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from app.sdk import Base, CallView, CheckResult, RolloutState, RolloutView
from tests.retail.corpus import (
    RESOURCES,
    build_dataset,
    get_task,
    gold_calls,
    gold_changes,
    load_tasks,
    replay,
    replay_calls,
    split_task_ids,
)
from tests.retail.rollout import Rollout
from tools.retail import pack
from tools.retail.check import NO_TOOL_CALLS, PREMATURE_END, RetailItemError, check_rollout, communicated
from tools.retail.tasks import Replay, ToolCall
from tools.retail.tools import modify_user_address


def grade(
    base: Base,
    result: Replay,
    item: Mapping[str, Any],
    answer: str,
    calls: Sequence[ToolCall] | None = None,
    *,
    ended_by: str | None = None,
) -> CheckResult:
    views = [
        CallView(tool=r.tool, arguments=r.arguments, output="", outcome="model_error" if r.error else "ok")
        for r in result.results
    ]
    if calls is not None:
        views = [
            CallView(tool=name, arguments=arguments, output="", outcome="ok") for name, arguments in calls
        ]
    view = RolloutView(
        trace_id="trace_test",
        item=item,
        sample={"output_text": answer} if ended_by is None else {"output_text": answer, "ended_by": ended_by},
        final_answer=answer,
        calls=views,
        state=result.state(base),
        resources=RESOURCES,
    )
    return check_rollout(view)


def answer_for(task_id: str) -> str:
    return "Done. " + " and ".join(get_task(task_id).evaluation_criteria.communicate_info)


def last_successful_write(result: Replay) -> int | None:
    writes = [
        index
        for index, call in enumerate(result.results)
        if pack.tools[call.tool].mutates and call.error is None
    ]
    return writes[-1] if writes else None


@pytest.mark.parametrize("split", ["train", "test"])
def test_replaying_each_tasks_gold_calls_scores_1(split: str, base: Base) -> None:
    failures = []
    for task_id in split_task_ids(split):  # type: ignore[arg-type]
        result = replay(replay_calls(task_id))
        graded = grade(base, result, {"task_id": task_id}, answer_for(task_id))
        if graded.score != 1.0 or graded.flags:
            failures.append((task_id, graded))
    assert failures == []


def test_dropping_the_last_write_of_a_train_task_scores_db_0(base: Base) -> None:
    checked, failures = 0, []
    for task_id in split_task_ids("train"):
        calls = gold_calls(task_id)
        cut = last_successful_write(replay(calls))
        if cut is None:
            continue  # nothing to drop: the task's database must stay as shipped
        checked += 1
        graded = grade(
            base, replay(calls[:cut] + calls[cut + 1 :]), {"task_id": task_id}, answer_for(task_id)
        )
        if graded.sub_scores["db"] != 0.0 or graded.score != 0.0:
            failures.append(task_id)
    assert failures == []
    assert checked >= 60  # most tasks change the database


def test_the_dataset_lines_fields_grade_like_the_task(base: Base) -> None:
    line = next(line for line in build_dataset("train") if line["task_id"] == "21")
    item = {key: value for key, value in line.items() if key not in ("messages", "tools")}
    result = replay(gold_calls("21"))
    assert grade(base, result, item, "Your gift card balance is now $44.08.").score == 1.0
    # The row's own actions are used: a row whose gold says "change nothing" fails this rollout's database.
    assert grade(base, result, {**item, "actions": []}, "$44.08").sub_scores["db"] == 0.0


def test_the_gold_database_agrees_with_the_benchmarks_expected_answers(base: Base) -> None:
    # Task 21 expects the agent to tell the customer their gift card balance after the change: 44.08.
    state = RolloutState(base, gold_changes(gold_calls("21")), writable=False)
    assert state.get("users", "ethan_garcia_1261")["payment_methods"]["gift_card_4332117"]["balance"] == 44.08
    # Task 16 expects the total that its gold `calculate` call returns.
    results = replay(gold_calls("16")).results
    assert [r.result for r in results if r.tool == "calculate"] == ["8276.23"]
    assert get_task("16").evaluation_criteria.communicate_info == ["8276.23"]


def test_every_gold_write_that_fails_fails_for_the_scenarios_reason() -> None:
    # Gold trajectories include the refusals their scenarios provoke; any other failure would be our bug.
    failed = {
        task_id: [
            (r.tool, r.error)
            for r in replay(gold_calls(task)).results
            if r.error and pack.tools[r.tool].mutates
        ]
        for task_id, task in load_tasks().items()
    }
    assert {task_id: errors for task_id, errors in failed.items() if errors} == {
        "12": [("return_delivered_order_items", "Payment method should be the original payment method")],
        "13": [("return_delivered_order_items", "Payment method should be the original payment method")],
        "64": [("exchange_delivered_order_items", "Non-delivered order cannot be exchanged")],
        "105": [
            (
                "exchange_delivered_order_items",
                "Insufficient gift card balance to pay for the price difference",
            )
        ],
    }


def test_an_extra_write_fails_the_database_check(base: Base) -> None:
    calls = gold_calls("0")
    rollout = Rollout(base)
    rollout.changes = replay(calls).changes
    rollout.call(
        modify_user_address,
        user_id="yusuf_rossi_9620",
        address1="1 Elm St",
        address2="",
        city="Austin",
        state="TX",
        country="USA",
        zip="73301",
    )
    graded = grade(base, Replay(rollout.changes, []), {"task_id": "0"}, "", calls=calls)
    assert graded.sub_scores == {"db": 0.0, "communicate": 1.0}
    assert graded.score == 0.0


def test_missing_facts_fail_the_communicate_check(base: Base) -> None:
    result = replay(gold_calls("29"))
    assert get_task("29").evaluation_criteria.communicate_info == ["180.1", "189.57", "208.6"]
    partial = grade(base, result, {"task_id": "29"}, "The totals are 180.10 and 189.57.")
    assert partial.sub_scores == {"db": 1.0, "communicate": 0.0}
    assert partial.score == 0.0
    full = grade(base, result, {"task_id": "29"}, "Totals: 180.10, 189.57 and 208.60.")
    assert full.score == 1.0  # '180.1' is in '180.10', as in τ²-bench


def test_facts_told_in_send_message_to_user_count_as_communicated(base: Base) -> None:
    # A tool-only loop (SPARRING_USER_TOOL) tells the customer through send_message_to_user: each of its
    # answered messages counts, as each of the agent's messages does in τ²-bench.
    result = replay(gold_calls("29"))
    told = [("send_message_to_user", {"message": f"The total is {total}."}) for total in ("180.10", "189.57")]
    calls = [*((r.tool, r.arguments) for r in result.results), *told]
    partial = grade(base, result, {"task_id": "29"}, "Anything else?", calls)
    assert partial.sub_scores == {"db": 1.0, "communicate": 0.0}
    last = ("send_message_to_user", {"message": "And the last one is 208.60."})
    full = grade(base, result, {"task_id": "29"}, "Anything else?", [*calls, last])
    assert full.sub_scores == {"db": 1.0, "communicate": 1.0} and full.score == 1.0


def test_communicated_ignores_case_and_commas() -> None:
    assert communicated("1093.34", "You will be refunded $1,093.34.")
    assert communicated("Polyester", "one is made of POLYESTER")
    assert communicated("943 Maple Drive", "shipping to 943 maple drive, Suite 356")
    assert not communicated("1093.34", "You will be refunded $1093.3")


def test_a_rollout_without_calls_scores_0_with_a_flag(base: Base) -> None:
    # Task 24 changes nothing and expects two facts: without a single call the answer is still worth 0.
    graded = grade(base, replay([]), {"task_id": "24"}, "They are made of polyester and cotton.")
    assert graded.score == 0.0
    assert graded.sub_scores == {"db": 1.0, "communicate": 1.0}
    assert [name for name, _ in graded.flags] == [NO_TOOL_CALLS]


@pytest.mark.parametrize("ended_by", ["max_steps", "too_many_errors"])
def test_a_conversation_cut_short_scores_0_with_a_flag(base: Base, ended_by: str) -> None:
    # τ²-bench's evaluate_simulation rewards a simulation that ended by MAX_STEPS or TOO_MANY_ERRORS 0
    # ("terminated prematurely"), however right its database and its messages are.
    task_id = split_task_ids("train")[0]
    graded = grade(
        base, replay(replay_calls(task_id)), {"task_id": task_id}, answer_for(task_id), ended_by=ended_by
    )
    assert graded.score == 0.0
    assert graded.sub_scores == {"db": 1.0, "communicate": 1.0}
    ((name, reason),) = graded.flags
    assert name == PREMATURE_END and ended_by in reason


@pytest.mark.parametrize("ended_by", ["user_stop", "user_transfer", "user_out_of_scope"])
def test_a_conversation_the_user_ended_scores_as_before(base: Base, ended_by: str) -> None:
    # Each of the user's tokens (###STOP###, ###TRANSFER###, ###OUT-OF-SCOPE###) is τ²'s USER_STOP: graded.
    task_id = split_task_ids("train")[0]
    graded = grade(
        base, replay(replay_calls(task_id)), {"task_id": task_id}, answer_for(task_id), ended_by=ended_by
    )
    assert graded.score == 1.0 and not graded.flags


def test_a_row_that_names_no_task_is_an_error_not_a_score(base: Base) -> None:
    with pytest.raises(RetailItemError, match="task_id"):
        grade(base, replay([]), {}, "")
    with pytest.raises(RetailItemError, match="'nope'"):
        grade(base, replay([]), {"task_id": "nope"}, "")
    with pytest.raises(RetailItemError, match=r"item\.actions"):
        grade(base, replay([]), {"actions": [{"arguments": {}}]}, "")


def test_the_gold_database_is_computed_once_per_task() -> None:
    assert gold_changes(gold_calls("0")) is gold_changes(gold_calls("0"))
