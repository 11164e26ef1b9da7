"""A grader that cannot use the dataset row it was sent: an error the trainer sees, never a false 0."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import select

from app.db.models import Grade
from app.deps import app_state
from app.sdk import CheckResult, GradingConfigError, Pack, RolloutView, ToolContext
from tests.conftest import ADMIN_KEY, AppFactory, call_body, new_trace
from tests.grading.test_routes import GRADERS, sample, write_graders

quiz_pack = Pack("quiz", base=lambda resources: {"answers": {}})


@quiz_pack.tool(mutates=True)
def answer(ctx: ToolContext, text: str) -> str:
    """Record an answer."""
    ctx.state.put("answers", "last", {"text": text})
    return "ok"


@quiz_pack.state_check("quiz")
def quiz_check(view: RolloutView) -> CheckResult:
    """1 when the last answer is the item's `expected`."""
    expected = view.item.get("expected")
    if not isinstance(expected, str):
        raise GradingConfigError(
            f"the quiz grader needs item.expected, a string; the item has {sorted(view.item)}"
        )
    last = view.state.get("answers", "last")
    return CheckResult(score=1.0 if last is not None and last["text"] == expected else 0.0)


GRADER_SET = {
    "exact": GRADERS["exact"],  # reads item.reference_answer
    "both": {
        "type": "multi",
        "name": "both",
        "graders": {
            "quiz": {"type": "state_check", "name": "quiz", "check": "quiz"},
            "exact": GRADERS["exact"],
        },
        "calculate_output": "quiz * exact",
    },
}


async def stored(client: object, trace: str) -> list[Grade]:
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        return list(
            (await session.scalars(select(Grade).where(Grade.trace_id == trace).order_by(Grade.id))).all()
        )


async def test_an_unusable_item_is_a_422_and_a_failed_grade_logged_once_per_cause(
    app_factory: AppFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    graders = write_graders(tmp_path, GRADER_SET)
    async with app_factory(packs=[quiz_pack], key=ADMIN_KEY, graders_file=graders) as client:
        trace = new_trace()
        call = await client.post("/tools/answer", json=call_body({"text": "b"}, trace_id=trace, call_id="c1"))
        assert call.status_code == 200
        good = {"sample": sample("b"), "item": {"expected": "b", "reference_answer": "b"}, "trace_id": trace}
        for name in ("quiz", "both", "exact"):
            assert (await client.post(f"/grade/{name}", json=good)).json() == {"score": 1.0}
        caplog.set_level(logging.ERROR)
        for name, item in (
            ("quiz", {"reference_answer": "b"}),  # the state check's own field is missing
            ("both", {"reference_answer": "b"}),  # ... inside a multi grader
            ("exact", {"expected": "b"}),  # a template reads an item field the row lacks
        ):
            for _ in range(3):
                response = await client.post(f"/grade/{name}", json={**good, "item": item})
                assert response.status_code == 422, (name, response.text)
                error = response.json()["error"]
                assert error["code"] == "grader_config_error" and "item" in error["message"], error
        not_an_object = await client.post("/grade/exact", json={**good, "item": "not an object"})
        assert not_an_object.status_code == 422, not_an_object.text
        grades = await stored(client, trace)
        assert [(g.grader, g.status, g.score) for g in grades[:3]] == [
            (n, "ok", 1.0) for n in ("quiz", "both", "exact")
        ]
        failed = grades[3:]
        assert len(failed) == 10 and all(g.status == "failed" and g.score is None for g in failed)
        assert all(g.errors and "item" in g.errors[0] for g in failed)
        assert any(flag["name"] == "grade_failed" for flag in failed[0].flags)
        loud = [r for r in caplog.records if r.levelno >= logging.ERROR and "configuration" in r.getMessage()]
        assert len(loud) == 4, [r.getMessage() for r in loud]  # once per grader and cause, not per grade
