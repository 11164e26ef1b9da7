"""The grader routes end to end: real tool calls, then POST /grade/{name}, on both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import select

from app.db.models import Grade, RolloutRow
from app.deps import app_state
from app.errors import StartupError
from app.sdk import CheckResult, Pack, RolloutView, ToolContext
from tests.conftest import ADMIN_KEY, GRADER_KEY, TOOLS_KEY, AppFactory, call_body, new_trace
from tests.grading.judge_server import JudgeServer

TOOLS = {"Authorization": f"Bearer {TOOLS_KEY}"}

ledger_pack = Pack("ledger", base=lambda resources: {"accounts": {"alice": {"balance": 100}}})


@ledger_pack.tool(mutates=True)
def pay(ctx: ToolContext, amount: int) -> dict[str, int]:
    """Take `amount` from alice's balance."""
    account = ctx.state.get("accounts", "alice")
    account["balance"] -= amount
    ctx.state.put("accounts", "alice", account)
    return {"balance": account["balance"]}


@ledger_pack.tool
def balance(ctx: ToolContext) -> dict[str, int]:
    """Alice's balance."""
    return {"balance": ctx.state.get("accounts", "alice")["balance"]}


@ledger_pack.state_check("final_balance")
def final_balance(view: RolloutView) -> CheckResult:
    """1 when alice's final balance is the item's `expected_balance`."""
    actual = view.state.get("accounts", "alice")["balance"]
    expected = view.item.get("expected_balance")
    return CheckResult(score=1.0 if actual == expected else 0.0, sub_scores={"balance": float(actual)})


GRADERS: dict[str, Any] = {
    "exact": {
        "type": "string_check",
        "name": "exact",
        "operation": "eq",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
    },
    "efficient": {
        "type": "multi",
        "name": "efficient",
        "graders": {
            "correct": {
                "type": "string_check",
                "name": "correct",
                "operation": "eq",
                "input": "{{ sample.output_text }}",
                "reference": "{{ item.reference_answer }}",
            },
            "budget": {"type": "tool_budget", "name": "budget", "max_calls": 2},
            "state": {"type": "state_check", "name": "state", "check": "final_balance"},
        },
        "calculate_output": "correct * state * budget",
    },
    "grounded": {"type": "grounded", "name": "grounded"},
    "count": {
        "type": "python",
        "name": "count",
        "source": "def grade(sample, item):\n    return min(1.0, len(sample.get('output_text', '')) / 10)\n",
    },
}


def write_graders(tmp_path: Path, graders: dict[str, Any], name: str = "graders.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(graders, sort_keys=False))
    return path


def sample(text: str) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "output_text": text,
        "output_json": None,
        "output_tools": [],
    }


async def pay_call(
    client: httpx.AsyncClient, trace: str, call_id: str, amount: int, *, run: str | None = None
) -> str:
    response = await client.post(
        "/tools/pay",
        json=call_body({"amount": amount}, trace_id=trace, call_id=call_id),
        headers={**TOOLS, **({"X-Sparring-Run": run} if run else {})},
    )
    assert response.status_code == 200, response.text
    return str(response.json()["output"])


async def stored_grades(
    client: httpx.AsyncClient, trace: str | None = None, *, run: str | None = None, grader: str | None = None
) -> list[Grade]:
    """Grades of this test (the Postgres database is shared by the session's tests)."""
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        query = select(Grade).order_by(Grade.id)
        if trace is not None:
            query = query.where(Grade.trace_id == trace)
        if run is not None:
            query = query.where(Grade.run == run)
        if grader is not None:
            query = query.where(Grade.grader == grader)
        return list((await session.scalars(query)).all())


async def test_trace_aware_multi_reads_the_calls_and_the_final_state(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path, GRADERS)
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=graders) as client:
        good, retried, wasteful = new_trace(), new_trace(), new_trace()
        await pay_call(client, good, "c1", 30)
        # A retried call (same call_id) is applied once: the final state is still 70.
        await pay_call(client, retried, "c1", 30)
        assert await pay_call(client, retried, "c1", 30) == '{"balance":70}'
        for i in range(4):  # over the budget of 2 calls, and the balance ends at 60
            await pay_call(client, wasteful, f"c{i}", 10)
        item = {"id": "q1", "reference_answer": "70", "expected_balance": 70}

        scores = {}
        for trace in (good, retried, wasteful):
            response = await client.post(
                "/grade/efficient", json={"sample": sample("70"), "item": item, "trace_id": trace, "x": 1}
            )
            assert response.status_code == 200, response.text
            assert set(response.json()) == {"score"}
            scores[trace] = response.json()["score"]
        assert scores[good] == 1.0
        assert scores[retried] == 1.0
        assert scores[wasteful] == 0.0  # wrong final state, whatever the budget says

        [grade] = await stored_grades(client, wasteful)
        assert grade.grader == "efficient" and grade.status == "ok" and grade.score == 0.0
        assert grade.sub_scores["state"] == 0.0 and grade.sub_scores["correct"] == 1.0
        assert grade.sub_scores["budget"] < 1.0
        assert len(grade.grader_version) >= 8
        assert grade.item == item and grade.sample["output_text"] == "70"
        assert grade.item_key == "id:q1"
        names = {flag["name"] for flag in grade.flags}
        assert "over_budget" in names  # the budget grader's own flag is kept next to the review's
        async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
            rollout = await session.get(RolloutRow, wasteful)
        assert rollout is not None and rollout.graded_at is not None


async def test_grounded_answers_score_by_what_the_tools_returned(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path, GRADERS)
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=graders) as client:
        trace = new_trace()
        await pay_call(client, trace, "c1", 25)  # the tool said 75
        grounded = await client.post(
            "/grade/grounded", json={"sample": sample("The balance is 75."), "trace_id": trace}
        )
        invented = await client.post(
            "/grade/grounded",
            json={"sample": sample("The balance is 75, after a fee of 1234."), "trace_id": trace},
        )
        assert grounded.json() == {"score": 1.0}
        assert invented.json() == {"score": 0.5}
        grades = await stored_grades(client, trace)
        assert [g.score for g in grades] == [1.0, 0.5]
        assert "ungrounded_answer" in {f["name"] for f in grades[1].flags}
        assert "ungrounded_answer" not in {f["name"] for f in grades[0].flags}


async def test_a_trace_without_calls_is_graded_and_flagged(app_factory: AppFactory, tmp_path: Path) -> None:
    graders = write_graders(tmp_path, GRADERS)
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=graders) as client:
        trace = new_trace()
        response = await client.post(
            "/grade/exact",
            json={"sample": sample("70"), "item": {"reference_answer": "70"}, "trace_id": trace},
        )
        assert response.json() == {"score": 1.0}
        [grade] = await stored_grades(client, trace)
        assert "high_score_no_calls" in {f["name"] for f in grade.flags}
        async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
            rollout = await session.get(RolloutRow, trace)
        assert rollout is not None and rollout.graded_at is not None  # so the review lists it


REF = {"reference_answer": "x"}


@pytest.mark.parametrize(
    ("body", "score"),
    [
        # Whatever the model's sample lacks scores low with 200, never a 5xx (an item lacking what the
        # grader reads is a configuration error: tests/grading/test_config_errors.py).
        ({"item": REF}, 0.0),
        ({"sample": None, "item": REF}, 0.0),
        ({"sample": "x", "item": REF}, 0.0),
        ({"sample": {"output_text": None}, "item": REF}, 0.0),
        ({"sample": {"choices": [{"message": {"content": "x"}}]}, "item": REF}, 0.0),  # no output_text
        ({"sample": sample("x"), "item": REF, "trace_id": None, "extra": [1]}, 1.0),
        ({"sample": sample("x"), "item": REF, "trace_id": 12345}, 1.0),
        ({"sample": sample("x"), "item": REF, "trace_id": "t" * 500}, 1.0),  # stored under a hashed key
    ],
)
async def test_the_body_is_read_tolerantly(
    app_factory: AppFactory, tmp_path: Path, body: dict[str, Any], score: float
) -> None:
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=graders) as client:
        # One grader configured: it is the default of POST /grade.
        for path in ("/grade", "/grade/exact"):
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            assert response.json() == {"score": score}


async def test_operator_errors_are_4xx_with_a_stable_body(app_factory: AppFactory, tmp_path: Path) -> None:
    graders = write_graders(tmp_path, GRADERS)
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=graders) as client:
        unknown = await client.post("/grade/nope", json={})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "not_found"
        assert "exact" in unknown.json()["error"]["details"]["available"]
        no_default = await client.post("/grade", json={})  # several graders, none chosen
        assert no_default.status_code == 404 and "SPARRING_DEFAULT_GRADER" in no_default.text
        not_json = await client.post("/grade/exact", content=b"{oops")
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "bad_request"
        not_object = await client.post("/grade/exact", json=[1, 2])
        assert not_object.status_code == 400
        tools_key = await client.post("/grade/exact", json={}, headers=TOOLS)
        assert tools_key.status_code == 403
        no_key = await client.post("/grade/exact", json={}, headers={"Authorization": ""})
        assert no_key.status_code == 401
        listed = await client.get("/grade")
        assert {g["name"] for g in listed.json()} == {*GRADERS, "final_balance"}
        run = {"X-Sparring-Run": "operator-errors"}
        assert (await client.post("/grade/nope", json={}, headers=run)).status_code == 404
        assert await stored_grades(client, run="operator-errors") == []  # nothing was graded


async def test_the_default_grader_setting(app_factory: AppFactory, tmp_path: Path) -> None:
    graders = write_graders(tmp_path, GRADERS)
    async with app_factory(
        packs=[ledger_pack], key=ADMIN_KEY, graders_file=graders, default_grader="count"
    ) as client:
        response = await client.post("/grade", json={"sample": sample("12345")})
        assert response.json() == {"score": 0.5}
        [grade] = await stored_grades(client, grader="count")
        assert grade.trace_id is None


async def test_a_judge_outage_answers_503_and_is_recorded_as_failed(
    app_factory: AppFactory, tmp_path: Path, judge_server: JudgeServer
) -> None:
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": "down",
        "input": [{"role": "user", "content": "Rate: {{ sample.output_text }}"}],
        "range": [0, 1],
    }
    graders = write_graders(tmp_path, {"judge": judge})
    async with app_factory(
        packs=[ledger_pack],
        key=GRADER_KEY,
        graders_file=graders,
        judge_base_url=judge_server.base_url,
        judge_api_key="test",
        judge_max_retries=0,
    ) as client:
        trace = new_trace()
        response = await client.post("/grade/judge", json={"sample": sample("fine"), "trace_id": trace})
        assert response.status_code == 503
        assert response.headers["Retry-After"]
        assert response.json()["error"]["code"] == "grader_unavailable"
        # Where the judge runs is the server's business: it is in the stored grade, not the answer.
        assert judge_server.base_url.split("//")[1].split("/")[0] not in response.text, response.text
        [grade] = await stored_grades(client, trace)
        assert grade.status == "failed" and grade.score is None and grade.errors
        assert "grade_failed" in {f["name"] for f in grade.flags}


async def test_regrade_rescores_stored_rollouts_with_the_current_config(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    before = write_graders(tmp_path, {"exact": GRADERS["exact"]}, "before.yaml")
    loose = {**GRADERS["exact"], "operation": "ilike"}
    after = write_graders(tmp_path, {"exact": loose}, "after.yaml")
    answers = ["70", "The answer is 70", "seventy"]
    run = f"regrade-{new_trace()}"
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=before) as client:
        for i, text in enumerate(answers):
            response = await client.post(
                "/grade/exact",
                json={
                    "sample": sample(text),
                    "item": {"id": i, "reference_answer": "70"},
                    "trace_id": new_trace(),
                },
                headers={"X-Sparring-Run": run},
            )
            assert response.status_code == 200
        old_version = (await stored_grades(client, run=run))[0].grader_version
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=after) as client:
        report = await app_state(client.app).grading.regrade("exact", run=run)  # type: ignore[attr-defined]
        assert (report.rollouts, report.changed, report.failed) == (3, 1, 0)
        assert report.mean_before == pytest.approx(1 / 3)
        assert report.mean_after == pytest.approx(2 / 3)
        grades = await stored_grades(client, run=run)
        assert len(grades) == 6
        assert {g.grader_version for g in grades[3:]} == {report.version} != {old_version}
        # A second regrade reads the newest grade of each rollout: nothing changes any more.
        again = await app_state(client.app).grading.regrade("exact", run=run)  # type: ignore[attr-defined]
        assert (again.rollouts, again.changed) == (3, 0)


@pytest.mark.parametrize(
    ("graders", "expected"),
    [
        ({"bad": {"type": "nonsense", "name": "bad"}}, ["grader 'bad'", "type"]),
        (
            {"tpl": {**GRADERS["exact"], "input": "{{ sample.output_text"}},
            ["grader 'tpl'", "input"],
        ),
        ({"unk": {**GRADERS["exact"], "reference": "{{ answer.x }}"}}, ["grader 'unk'", "reference"]),
        (
            {
                "m": {
                    "type": "text_similarity",
                    "name": "m",
                    "input": "a",
                    "reference": "b",
                    "evaluation_metric": "meteor",
                    "pass_threshold": 0.5,
                }
            },
            ["grader 'm'", "meteor"],
        ),
    ],
)
async def test_bad_configs_fail_at_start_up_with_file_grader_and_field(
    app_factory: AppFactory, tmp_path: Path, graders: dict[str, Any], expected: list[str]
) -> None:
    path = write_graders(tmp_path, graders)
    with pytest.raises(StartupError) as failure:
        async with app_factory(packs=[ledger_pack], graders_file=path):
            pass
    message = str(failure.value)
    assert str(path) in message
    for part in expected:
        assert part in message


async def test_an_unknown_default_grader_fails_at_start_up(app_factory: AppFactory, tmp_path: Path) -> None:
    path = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    with pytest.raises(StartupError, match="SPARRING_DEFAULT_GRADER='missing'"):
        async with app_factory(packs=[ledger_pack], graders_file=path, default_grader="missing"):
            pass


async def test_a_second_regrade_scores_each_traceless_answer_once(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    # Grades posted without a trace_id: a regrade stores new ones beside them, and the next regrade
    # must not score those copies as more answers.
    path = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    run = f"traceless-{new_trace()}"
    async with app_factory(packs=[ledger_pack], key=GRADER_KEY, graders_file=path) as client:
        for i, text in enumerate(["70", "seventy"]):
            response = await client.post(
                "/grade/exact",
                json={"sample": sample(text), "item": {"id": i, "reference_answer": "70"}},
                headers={"X-Sparring-Run": run},
            )
            assert response.status_code == 200
        grading = app_state(client.app).grading  # type: ignore[attr-defined]
        first = await grading.regrade("exact", run=run)
        second = await grading.regrade("exact", run=run)
        assert (first.rollouts, second.rollouts) == (2, 2)
        assert second.mean_after == pytest.approx(0.5)
