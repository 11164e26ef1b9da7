"""GET /rollouts/{trace_id}/state: the materialized state of every rollout seen, 404 for one never seen."""

from __future__ import annotations

import httpx

from tests.conftest import ADMIN_KEY, AppFactory, call_body, new_trace
from tests.packs import counter_pack, faults_pack

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def state_of(client: httpx.AsyncClient, trace: str) -> httpx.Response:
    return await client.get(f"/rollouts/{trace}/state", headers=ADMIN)


async def test_a_rollout_that_changed_nothing_shows_its_base_and_an_unknown_one_is_404(
    app_factory: AppFactory,
) -> None:
    async with app_factory(packs=[counter_pack, faults_pack]) as client:
        unknown = await state_of(client, new_trace())
        assert unknown.status_code == 404, unknown.text
        assert unknown.json()["error"]["code"] == "not_found"

        reader = new_trace()
        read = await client.post("/tools/read_counter", json=call_body({}, trace_id=reader, call_id="c1"))
        assert read.json()["output"] == '{"value":100}'
        seen = await state_of(client, reader)
        assert seen.status_code == 200, seen.text
        assert seen.json() == {
            "trace_id": reader,
            "packs": {"counter": {"changed": {}, "state": {"counters": {"main": {"value": 100}}}}},
        }
        changed_only = await client.get(f"/rollouts/{reader}/state?changed_only=true", headers=ADMIN)
        assert changed_only.json()["packs"] == {"counter": {"changed": {}}}

        writer = new_trace()
        await client.post("/tools/increment", json=call_body({"by": 2}, trace_id=writer, call_id="c1"))
        assert (await state_of(client, writer)).json()["packs"] == {
            "counter": {
                "changed": {"counters": {"main": {"value": 102}}},
                "state": {"counters": {"main": {"value": 102}}},
            }
        }
