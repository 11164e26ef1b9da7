"""Long ids are shortened to fit their columns without ever merging two distinct ids."""

from __future__ import annotations

import httpx

from app.rollouts.identity import TRACE_ID_MAX, fit, item_key
from tests.conftest import call_body, new_trace


def test_fit_keeps_distinct_values_distinct() -> None:
    long_a, long_b = "a" * 300, "a" * 299 + "b"
    assert fit("short", 128) == "short"
    assert len(fit(long_a, 128)) == 128 and fit(long_a, 128) != fit(long_b, 128)
    # A value written exactly as another's abbreviation is not that value.
    forged = fit(long_a, 128)
    assert fit(forged, 128) != forged
    assert len(fit(forged, 128)) <= 128
    assert fit(fit(forged, 128), 128) != fit(forged, 128)


def test_item_keys_of_distinct_long_ids_stay_distinct() -> None:
    head = "task-" + "x" * 200
    first, second = item_key({"id": head + "1"}), item_key({"id": head + "2"})
    assert first != second
    assert first is not None and len(first) <= 128 and first.startswith("id:task-")
    assert item_key({"id": "7"}) == "id:7"
    # An id that looks like another's abbreviation does not take its statistics either.
    assert item_key({"id": first.removeprefix("id:")}) != first


async def test_a_forged_abbreviation_is_another_rollout(client: httpx.AsyncClient) -> None:
    long_trace = new_trace() + "-" + "z" * 300
    forged = fit(long_trace, TRACE_ID_MAX)
    ran = await client.post("/tools/increment", json=call_body({"by": 5}, trace_id=long_trace, call_id="c1"))
    assert ran.json()["output"] == '{"value":105}'
    other = await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=forged, call_id="c1"))
    assert other.json()["output"] == '{"value":101}', (
        "the forged id must not replay or share the long id's state"
    )
