"""Trace-aware graders on rollouts built here: budgets, loops, grounding, tools, state checks."""

from __future__ import annotations

from typing import Any

import pytest

from app.grading.graders.model import GradeInput, GraderConfigError, GradeResult, RolloutRecord
from app.grading.graders.registry import GraderContext, build_graders
from app.grading.graders.trace import pack_state
from app.grounding import CLAIMS_CHECKED, claims, ungrounded
from app.sdk import CheckResult, Pack, RolloutState, RolloutView
from tests.grading.records import call, grade_input, rollout


async def grade(context: GraderContext, config: dict[str, Any], inp: GradeInput) -> GradeResult:
    grader = build_graders({"g": config}, source="test", context=context)["g"]
    assert grader.needs_rollout
    return await grader.grade(inp)


def calls_of(*tools: str, outcome: str = "ok") -> RolloutRecord:
    return rollout([call(tool, {"n": i}, outcome=outcome) for i, tool in enumerate(tools)])


# --- tool_budget -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("calls", "max_calls", "decay", "expected"),
    [
        (0, 3, 0.8, 1.0),
        (3, 3, 0.8, 1.0),
        (4, 3, 0.8, 0.8),
        (6, 3, 0.8, 0.8**3),
        (13, 3, 0.8, 0.8**10),
        (4, 3, 0.0, 0.0),  # a hard cut
        (10, 3, 1.0, 1.0),  # no penalty at all
        (1, 0, 0.5, 0.5),
    ],
)
async def test_tool_budget(
    context: GraderContext, calls: int, max_calls: int, decay: float, expected: float
) -> None:
    config = {"type": "tool_budget", "max_calls": max_calls, "decay": decay}
    result = await grade(context, config, grade_input("x", record=calls_of(*["search"] * calls)))
    assert result.score == pytest.approx(expected)
    assert bool(result.flags) == (calls > max_calls)


async def test_tool_budget_counts_only_answered_calls(context: GraderContext) -> None:
    record = rollout(
        [
            call("search", outcome="ok"),
            call("search", outcome="model_error"),
            call("search", outcome="infra_error"),  # the platform retries these: not the model's doing
            call("search", outcome="tool_crash"),
        ]
    )
    result = await grade(context, {"type": "tool_budget", "max_calls": 2}, grade_input("x", record=record))
    assert result.score == 1.0


async def test_tool_budget_without_a_rollout_is_1(context: GraderContext) -> None:
    result = await grade(context, {"type": "tool_budget", "max_calls": 0}, grade_input("x"))
    assert result == GradeResult(score=1.0)


# --- no_loops ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("calls", "options", "expected"),
    [
        ([], {}, 1.0),
        ([call("get", {"id": 1}), call("get", {"id": 2})], {}, 1.0),
        ([call("get", {"id": 1}), call("get", {"id": 1})], {}, 0.5),
        ([call("get", {"id": 1})] * 4, {}, 0.25),
        # the same arguments in another key order, or as JSON text, are the same call
        ([call("get", {"a": 1, "b": 2}), call("get", '{"b": 2, "a": 1}')], {}, 0.5),
        # the same arguments to another tool are not a repeat
        ([call("get", {"id": 1}), call("delete", {"id": 1})], {}, 1.0),
        ([call("get", {"id": 1})] * 2, {"allowed_repeats": 1}, 1.0),
        ([call("get", {"id": 1})] * 3, {"allowed_repeats": 1}, 2 / 3),
        # re-reading after a change (another output) is not a loop with same_output_only
        (
            [call("get", {"id": 1}, "v1"), call("set", {"id": 1}, "ok"), call("get", {"id": 1}, "v2")],
            {"same_output_only": True},
            1.0,
        ),
        ([call("get", {"id": 1}, "v1"), call("get", {"id": 1}, "v1")], {"same_output_only": True}, 0.5),
        # a retried infrastructure failure is not the model repeating itself
        ([call("get", {"id": 1}, outcome="infra_error"), call("get", {"id": 1})], {}, 1.0),
    ],
)
async def test_no_loops(
    context: GraderContext, calls: list[dict[str, Any]], options: dict[str, Any], expected: float
) -> None:
    result = await grade(context, {"type": "no_loops", **options}, grade_input("x", record=rollout(calls)))
    assert result.score == pytest.approx(expected)
    assert [name for name, _ in result.flags] == ([] if expected == 1.0 else ["repeated_call"])


async def test_no_loops_without_a_rollout_is_1(context: GraderContext) -> None:
    assert (await grade(context, {"type": "no_loops"}, grade_input("x"))).score == 1.0


# --- grounded ----------------------------------------------------------------------------------------

ORDER = (
    '{"order_id": "W2378156", "total": 1234.5, "items": [{"name": "Urban Puffer Jacket", "price": 189.99}]}'
)


@pytest.mark.parametrize(
    ("answer", "outputs", "expected"),
    [
        ("I have cancelled the order.", [ORDER], 1.0),  # nothing to check, and a tool answered
        # The `guess` canary: a one-word answer given without a call rests on no tool output.
        ("Paris", [], 0.0),
        ("I have cancelled the order.", [], 0.0),
        ("", [], 1.0),  # an empty answer claims nothing
        ("The total is $1,234.50.", [ORDER], 1.0),
        ('You bought the "Urban Puffer Jacket" for 189.99.', [ORDER], 1.0),
        ('You bought the "urban puffer jacket".', [ORDER], 1.0),  # case and spacing do not matter
        ("The total is 999.99.", [ORDER], 0.0),
        ("The jacket costs 189.99 and shipping 12.75.", [ORDER], 0.5),
        ('Your "Alpine Parka" is on its way.', [ORDER], 0.0),
        ("You have 3 orders and 2 returns.", [ORDER], 1.0),  # small counts are not read facts
        ("Order W2378156 is cancelled.", [ORDER], 1.0),  # an identifier's digits are not a number
        ("It was 1e3 dollars.", ['{"amount": 1000}'], 1.0),
        ("It was 1000.00 dollars.", ["amount: 1,000"], 1.0),
        ("The total is 1234.5", ["no numbers here", ORDER], 1.0),  # any output of the rollout
        ("The total is 1234.5", [], 0.0),  # no calls: nothing grounds it
        ('The name is "Café Olé".', ['{"name": "Caf\\u00e9 Ol\\u00e9"}'], 1.0),  # JSON escapes undone
    ],
)
async def test_grounded(context: GraderContext, answer: str, outputs: list[str], expected: float) -> None:
    record = (
        rollout([call("lookup", {"i": i}, output) for i, output in enumerate(outputs)]) if outputs else None
    )
    result = await grade(context, {"type": "grounded"}, grade_input(answer, record=record))
    assert result.score == pytest.approx(expected)
    assert [name for name, _ in result.flags] == ([] if expected == 1.0 else ["ungrounded_answer"])


async def test_grounded_by_the_prompt(context: GraderContext) -> None:
    item = {"messages": [{"role": "user", "content": 'Please cancel order "W777", I paid 54.20 for it.'}]}
    answer = 'Order "W777" (54.20) is cancelled.'
    assert (await grade(context, {"type": "grounded"}, grade_input(answer, item))).score == 1.0
    strict = await grade(context, {"type": "grounded", "include_prompt": False}, grade_input(answer, item))
    assert strict.score == 0.0
    assert "'54.2'" in strict.flags[0][1] and "'W777'" in strict.flags[0][1]


async def test_grounded_reads_the_last_choice_or_a_template(context: GraderContext) -> None:
    record = rollout([call("lookup", {}, ORDER)])
    from_choices = grade_input(
        sample={"choices": [{"message": {"role": "assistant", "content": "The total is 55.55."}}]},
        record=record,
    )
    assert (await grade(context, {"type": "grounded"}, from_choices)).score == 0.0
    templated = grade_input(sample={"output_json": {"summary": "Total 1234.5"}}, record=record)
    config = {"type": "grounded", "input": "{{ sample.output_json.summary }}"}
    assert (await grade(context, config, templated)).score == 1.0


def test_claims() -> None:
    numbers, quoted = claims('Paid "$12.50" on 2024-05-01: total 1,234.50, ratio 0.75, v2, -42 and 7.', 10)
    assert quoted == ["$12.50"]
    assert numbers == ["2024", "1234.5", "0.75", "-42"]
    assert ungrounded("nothing", [], 10) == (0, [])


# --- required_tools / forbidden_tools ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (None, 0.0),
        (calls_of("search"), 0.5),
        (calls_of("search", "checkout"), 1.0),
        (calls_of("search", "search", "other"), 0.5),
        (
            rollout([call("search"), call("checkout", outcome="model_error")]),
            0.5,
        ),  # failed calls do not count
    ],
)
async def test_required_tools(context: GraderContext, record: RolloutRecord | None, expected: float) -> None:
    config = {"type": "required_tools", "tools": ["search", "checkout"]}
    result = await grade(context, config, grade_input("x", record=record))
    assert result.score == expected
    assert [name for name, _ in result.flags] == ([] if expected == 1.0 else ["missing_required_tool"])


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (None, 1.0),
        (calls_of("search"), 1.0),
        (calls_of("search", "issue_refund"), 0.0),
        (calls_of("issue_refund", outcome="model_error"), 0.0),  # trying is enough
    ],
)
async def test_forbidden_tools(context: GraderContext, record: RolloutRecord | None, expected: float) -> None:
    config = {"type": "forbidden_tools", "tools": ["issue_refund", "delete_account"]}
    result = await grade(context, config, grade_input("x", record=record))
    assert result.score == expected
    assert [name for name, _ in result.flags] == ([] if expected == 1.0 else ["forbidden_tool"])


# --- state checks --------------------------------------------------------------------------------------

bank = Pack("bank", base=lambda resources: {"accounts": {"A": {"balance": 100}, "B": {"balance": 0}}})
seen_views: list[RolloutView] = []


@bank.state_check("bank_transfer")
def check_transfer(view: RolloutView) -> CheckResult:
    """The expected balances, and whether the answer mentions the new balance."""
    seen_views.append(view)
    a = view.state.get("accounts", "A")["balance"]
    b = view.state.get("accounts", "B")["balance"]
    balances = 1.0 if (a, b) == tuple(view.item["expected"]) else 0.0
    told = 1.0 if str(a) in view.final_answer else 0.0
    flags = [] if view.calls else [("no_tool_calls", "nothing was called")]
    return CheckResult(score=balances * told, sub_scores={"balances": balances, "told": told}, flags=flags)


@bank.state_check("bank_async")
async def check_async(view: RolloutView) -> CheckResult:
    return CheckResult(score=0.25 if view.calls else 0.0)


@bank.state_check("bank_broken")
def check_broken(view: RolloutView) -> CheckResult:
    raise ValueError("the item has no 'expected'")


@bank.state_check("bank_wrong_type")
def check_wrong_type(view: RolloutView) -> Any:
    return 0.5


# The pack as an app that started it serves it (its base loaded).
served_bank = bank.started(None, bank.load_base(None))

TRANSFERRED = {"bank": {"accounts": {"A": {"balance": 60}, "B": {"balance": 40}}}}


@pytest.fixture
async def bank_context() -> Any:
    checks = {name: (served_bank, check) for name, check in bank.state_checks.items()}
    context = GraderContext(state_checks=checks)
    yield context
    await context.aclose()


async def test_state_checks_are_served_as_graders_without_config(bank_context: GraderContext) -> None:
    graders = build_graders({}, source="graders.yaml", context=bank_context)
    assert sorted(graders) == ["bank_async", "bank_broken", "bank_transfer", "bank_wrong_type"]
    record = rollout([call("transfer", {"from": "A", "to": "B", "amount": 40}, "done")], state=TRANSFERRED)
    result = await graders["bank_transfer"].grade(
        grade_input("A now has 60.", {"expected": [60, 40]}, record=record)
    )
    assert result == GradeResult(score=1.0, sub_scores={"balances": 1.0, "told": 1.0})
    view = seen_views[-1]
    assert view.trace_id == record.trace_id
    assert [c.tool for c in view.calls] == ["transfer"]
    assert view.calls[0].arguments == {"from": "A", "to": "B", "amount": 40}
    assert isinstance(view.state, RolloutState)


async def test_a_state_check_without_a_rollout_sees_the_base_state(bank_context: GraderContext) -> None:
    grader = build_graders({}, source="test", context=bank_context)["bank_transfer"]
    result = await grader.grade(grade_input("A has 100.", {"expected": [100, 0]}))
    assert result.score == 1.0
    assert result.flags == [("no_tool_calls", "nothing was called")]
    assert seen_views[-1].calls == []


async def test_state_check_in_a_multi_keeps_its_sub_scores(bank_context: GraderContext) -> None:
    config = {
        "type": "multi",
        "graders": {
            "db": {"type": "state_check", "check": "bank_transfer"},
            "budget": {"type": "tool_budget", "max_calls": 5},
        },
        "calculate_output": "db * budget",
    }
    grader = build_graders({"combined": config}, source="test", context=bank_context)["combined"]
    record = rollout([call("transfer")], state=TRANSFERRED)
    result = await grader.grade(grade_input("60 left", {"expected": [60, 40]}, record=record))
    assert result.score == 1.0
    assert result.sub_scores == {"db": 1.0, "db.balances": 1.0, "db.told": 1.0, "budget": 1.0}


async def test_async_checks_and_failing_checks(bank_context: GraderContext) -> None:
    graders = build_graders({}, source="test", context=bank_context)
    record = rollout([call("transfer")], state=TRANSFERRED)
    assert (await graders["bank_async"].grade(grade_input("x", record=record))).score == 0.25
    broken = await graders["bank_broken"].grade(grade_input("x", record=record))
    assert broken.score == 0.0
    assert broken.errors == ["state check 'bank_broken' raised ValueError: the item has no 'expected'"]
    assert broken.flags[0][0] == "state_check_failed"
    wrong = await graders["bank_wrong_type"].grade(grade_input("x", record=record))
    assert wrong.score == 0.0 and "not a CheckResult" in wrong.errors[0]


async def test_the_servers_pack_state_factory_is_used() -> None:
    asked: list[tuple[str, RolloutRecord | None]] = []

    def make_state(pack_name: str, record: RolloutRecord | None) -> RolloutState:
        asked.append((pack_name, record))
        return RolloutState({"accounts": {"A": {"balance": 7}, "B": {"balance": 3}}}, {}, writable=False)

    context = GraderContext(
        state_checks={"bank_transfer": (served_bank, check_transfer)}, make_pack_state=make_state
    )
    try:
        grader = build_graders({}, source="test", context=context)["bank_transfer"]
        record = rollout([call("transfer")])
        assert (await grader.grade(grade_input("7", {"expected": [7, 3]}, record=record))).score == 1.0
        assert asked == [("bank", record)]
    finally:
        await context.aclose()


def test_pack_state_applies_the_rollouts_changes() -> None:
    state = pack_state(served_bank, rollout(state={"bank": {"accounts": {"B": None, "C": {"balance": 1}}}}))
    assert state.keys("accounts") == ["A", "C"]
    assert pack_state(served_bank, None).get("accounts", "B") == {"balance": 0}


async def test_state_check_config_errors(bank_context: GraderContext) -> None:
    with pytest.raises(GraderConfigError, match="taken by the state check of pack 'bank'") as caught:
        build_graders(
            {"bank_transfer": {"type": "tool_budget", "max_calls": 1}}, source="g.yaml", context=bank_context
        )
    assert caught.value.grader == "bank_transfer"
    with pytest.raises(
        GraderConfigError, match="unknown state check 'bank'; the registered ones are: bank_async"
    ) as caught:
        build_graders({"db": {"type": "state_check", "check": "bank"}}, source="g.yaml", context=bank_context)
    assert caught.value.field == "check"


async def test_a_state_check_version_follows_its_code(bank_context: GraderContext) -> None:
    graders = build_graders({}, source="test", context=bank_context)
    versions = {name: g.version for name, g in graders.items()}
    assert len(set(versions.values())) == len(versions)
    again = build_graders({}, source="test", context=bank_context)
    assert {name: g.version for name, g in again.items()} == versions


async def test_grounded_scores_the_claims_it_checked(context: GraderContext) -> None:
    # More made-up numbers than are checked: the ones past the cap cannot count as grounded.
    answer = " ".join(str(1000 + i) for i in range(CLAIMS_CHECKED * 5))
    record = rollout([call("lookup", {}, ORDER)])
    result = await grade(context, {"type": "grounded"}, grade_input(answer, record=record))
    assert result.score == 0.0
    # Half of the checked ones grounded: half the score, however many more follow.
    grounded = " ".join(str(1000 + i) for i in range(CLAIMS_CHECKED // 2))
    half = " ".join([grounded, answer])
    record = rollout([call("lookup", {}, grounded)])
    result = await grade(context, {"type": "grounded"}, grade_input(half, record=record))
    assert result.score == pytest.approx(0.5)


async def test_a_state_check_may_score_with_a_boolean() -> None:
    # CheckResult(score=passed): True is a pass (1), as a python grader's True is, not a made-up 0.
    verdicts = Pack("verdicts", base=lambda resources: {})

    @verdicts.state_check("said_yes")
    def said_yes(view: RolloutView) -> CheckResult:
        return CheckResult(score=view.final_answer == "yes")  # type: ignore[arg-type]

    served = verdicts.started(None, verdicts.load_base(None))
    context = GraderContext(state_checks={"said_yes": (served, said_yes)})
    try:
        grader = build_graders({}, source="test", context=context)["said_yes"]
        passed = await grader.grade(grade_input("yes", record=rollout([call("look")])))
        failed = await grader.grade(grade_input("no", record=rollout([call("look")])))
    finally:
        await context.aclose()
    assert (passed.score, passed.errors) == (1.0, [])
    assert (failed.score, failed.errors) == (0.0, [])
