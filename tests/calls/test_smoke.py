"""A first end-to-end call on both backends."""

from __future__ import annotations

from tests.conftest import AppFactory, call_body, new_trace


async def test_increment_and_read_back(app_factory: AppFactory) -> None:
    trace = new_trace()
    async with app_factory() as client:
        r = await client.post("/tools/increment", json=call_body({"by": 2}, trace_id=trace, call_id="c1"))
        assert r.status_code == 200, r.text
        assert r.json() == {
            "type": "function_call_output",
            "call_id": "c1",
            "id": None,
            "output": '{"value":102}',
        }
        r = await client.post("/tools/read_counter", json=call_body("{}", trace_id=trace, call_id="c2"))
        assert r.json()["output"] == '{"value":102}'
