"""Grade requests no database can store as sent: nested too deeply, NUL characters. Never a 5xx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select

from app.db.models import Grade, RolloutRow
from app.deps import app_state
from tests.conftest import TOOLS_KEY, AppFactory, call_body, new_trace
from tests.grading.test_routes import GRADERS, ledger_pack, sample, write_graders

TOOLS = {"Authorization": f"Bearer {TOOLS_KEY}"}


def nest(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


def deep(levels: int) -> str:
    """JSON text of objects nested `levels` deep (deeper than Python's json module writes)."""
    return '{"a":' * levels + '"x"' + "}" * levels


async def test_sample_or_item_nested_too_deeply_is_a_400(app_factory: AppFactory, tmp_path: Path) -> None:
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    async with app_factory(packs=[ledger_pack], key="admin-key-789", graders_file=graders) as client:
        for body in (
            f'{{"sample": {{"output_text": "a", "deep": {deep(300)}}}, "item": {{"reference_answer": "a"}}}}',
            f'{{"sample": {{"output_text": "a"}}, "item": {{"reference_answer": "a", "deep": {deep(300)}}}}}',
            f'{{"sample": {deep(980)}, "item": {{}}}}',
            f'{{"sample": {{}}, "item": {{"deep": [{deep(200)}]}}, "trace_id": "{new_trace()}"}}',
        ):
            response = await client.post("/grade/exact", content=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "bad_request"
            assert "nests more than" in response.json()["error"]["message"]
        # As deep as a real row ever is: graded as usual.
        fine = await client.post(
            "/grade/exact", json={"sample": sample("a"), "item": {"reference_answer": "a", "deep": nest(40)}}
        )
        assert fine.status_code == 200 and fine.json() == {"score": 1.0}


async def test_nul_in_sample_item_and_trace_id_is_graded_and_stored(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    trace = new_trace() + "\x00nul"
    async with app_factory(packs=[ledger_pack], key="admin-key-789", graders_file=graders) as client:
        call = await client.post(
            "/tools/pay", json=call_body({"amount": 1}, trace_id=trace, call_id="c1"), headers=TOOLS
        )
        assert call.status_code == 200, call.text
        body = {
            "sample": sample("W-1\x00 refunded"),
            "item": {"id": "task\x001", "reference_answer": "W-1\x00 refunded", "note\x00key": ["\x00"]},
            "trace_id": trace,
        }
        response = await client.post("/grade/exact", json=body)
        assert response.status_code == 200, response.text
        assert response.json() == {"score": 1.0}, "the grader sees what was sent"
        stored_trace = trace.replace("\x00", "\ufffd")
        async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
            [grade] = (await session.scalars(select(Grade).where(Grade.trace_id == stored_trace))).all()
            rollout = await session.get(RolloutRow, stored_trace)
        # Stored as Postgres text can hold it, NUL as U+FFFD, on both backends alike.
        assert grade.status == "ok" and grade.score == 1.0
        assert grade.sample["output_text"] == "W-1\ufffd refunded"
        assert grade.item == {
            "id": "task\ufffd1",
            "reference_answer": "W-1\ufffd refunded",
            "note\ufffdkey": ["\ufffd"],
        }
        assert grade.item_key == "id:task\ufffd1"
        assert rollout is not None and rollout.graded_at is not None and rollout.calls == 1


async def test_a_trace_id_nested_too_deeply_is_a_400(app_factory: AppFactory, tmp_path: Path) -> None:
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    async with app_factory(packs=[ledger_pack], key="admin-key-789", graders_file=graders) as client:
        for trace_id in ("[" * 1000 + "]" * 1000, '{"a":' * 1000 + "1" + "}" * 1000):
            body = f'{{"sample": {{"output_text": "a"}}, "item": {{}}, "trace_id": {trace_id}}}'
            response = await client.post("/grade/exact", content=body)
            assert response.status_code == 400, response.text[:300]
            assert response.json()["error"]["code"] == "bad_request"
            assert "trace_id" in response.json()["error"]["message"]
