"""Long ids are shortened to fit their columns without ever merging two distinct ids."""

from __future__ import annotations

import httpx
from sqlalchemy import select

from app.db.models import ToolCall
from app.deps import app_state
from app.rollouts.identity import TRACE_ID_MAX, fit, item_key
from tests.conftest import ADMIN_KEY, call_body, new_trace

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


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


async def test_the_store_and_the_log_key_a_rollout_and_a_call_alike(client: httpx.AsyncClient) -> None:
    """A NUL is stored as U+FFFD in the log (app/db/text.py); the store keys the ids the same way, so
    the ids that name one rollout (or one call) in the log name it in the store too."""
    base = new_trace()
    with_nul, with_replacement = f"{base}-\x00", f"{base}-\ufffd"

    async def increment(trace: str, call_id: str, by: int) -> str:
        body = call_body({"by": by}, trace_id=trace, call_id=call_id)
        return str((await client.post("/tools/increment", json=body)).json()["output"])

    assert await increment(with_nul, "c\x001", 5) == '{"value":105}'
    # The rollout the log names with_replacement: its state, and its call's answer in the ledger.
    assert await increment(with_replacement, "c2", 1) == '{"value":106}', "the same rollout's state"
    assert await increment(with_replacement, "c\ufffd1", 5) == '{"value":105}', "the same call, replayed"
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rows = (await session.execute(select(ToolCall.trace_id, ToolCall.call_id, ToolCall.outcome))).all()
    mine = sorted((call, outcome) for trace, call, outcome in rows if trace == with_replacement)
    assert mine == [("c2", "ok"), ("c\ufffd1", "ok"), ("c\ufffd1", "replayed")]


def test_a_row_holding_an_integer_beyond_64_bits_has_a_key() -> None:
    """A dataset read with `json` may hold integers orjson cannot write: the row is still keyed, by
    its content, and two rows that differ only there keep distinct keys."""
    big = {"question": "q", "n": 2**70}
    bigger = {"question": "q", "n": 2**70 + 1}
    assert item_key(big) == item_key(dict(big)) is not None
    assert item_key(big) != item_key(bigger)
    assert item_key({"id": 2**70}) == f"id:{2**70}"


async def test_routes_find_a_long_trace_id_by_the_id_sent_and_by_its_key(client: httpx.AsyncClient) -> None:
    """A path names a rollout by the id its calls sent or by the key the review lists it under; a
    transcript PUT under the stored key (which ends in its digest) is the rollout's, not a new one's."""
    long_trace = new_trace() + "-" + "q" * 300
    key = fit(long_trace, TRACE_ID_MAX)
    ran = await client.post("/tools/increment", json=call_body({"by": 5}, trace_id=long_trace, call_id="c1"))
    assert ran.json()["output"] == '{"value":105}'
    for named in (long_trace, key):
        state = await client.get(f"/rollouts/{named}/state?changed_only=true", headers=ADMIN)
        assert state.status_code == 200, (named[:20], state.text)
        assert state.json()["trace_id"] == key
        detail = await client.get(f"/review/api/rollouts/{named}", headers=ADMIN)
        assert detail.status_code == 200, detail.text
        assert [call["call_id"] for call in detail.json()["timeline"]] == ["c1"]
    conversation = {"messages": [{"role": "user", "content": "count"}]}
    stored = await client.put(f"/rollouts/{key}/transcript", json=conversation, headers=ADMIN)
    assert stored.status_code == 200 and stored.json()["trace_id"] == key
    detail = (await client.get(f"/review/api/rollouts/{long_trace}", headers=ADMIN)).json()
    assert detail["transcript"]["messages"][0]["content"] == "count"
