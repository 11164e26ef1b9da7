"""Records read from and written to rollout state are private copies, whatever their shape."""

from __future__ import annotations

import copy
from collections import OrderedDict
from datetime import UTC, date, datetime
from typing import Any

import pytest

from app.sdk import Pack, RolloutState, ToolContext
from app.sdk.state import private_copy
from tests.conftest import AppFactory, call_body, new_trace

VALUES: list[Any] = [
    {"a": [1, 2.5, {"b": None, "c": True}], "d": "text", "e": {"f": [[], {}]}},
    [{"x": 1}, [2, [3]], "s"],
    ("tuple", ["with", "a list"]),  # not JSON-shaped: deepcopy's rules
    OrderedDict(a=[1]),
    {"when": datetime(2026, 1, 1, tzinfo=UTC), "set": {1, 2}},
    "plain",
    7,
    None,
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_private_copy_equals_deepcopy_and_shares_nothing_mutable(value: Any) -> None:
    copied = private_copy(value)
    assert copied == copy.deepcopy(value) and type(copied) is type(value)

    def mutables(obj: Any) -> list[int]:
        if isinstance(obj, dict):
            return [id(obj)] + [i for item in obj.values() for i in mutables(item)]
        if isinstance(obj, (list, set)):
            return [id(obj)] + [i for item in obj for i in mutables(item)]
        if isinstance(obj, tuple):
            return [i for item in obj for i in mutables(item)]
        return []

    assert not set(mutables(copied)) & set(mutables(value))


def test_state_hands_out_and_keeps_private_copies() -> None:
    base = {"orders": {"o1": {"items": [{"sku": "a", "qty": 1}]}}}
    state = RolloutState(base, {}, writable=True)
    record = state.get("orders", "o1")
    record["items"][0]["qty"] = 5
    assert base["orders"]["o1"]["items"][0]["qty"] == 1  # the shared base is untouched
    state.put("orders", "o1", record)
    record["items"].append({"sku": "b"})  # changing it after put changes nothing stored
    assert state.get("orders", "o1") == {"items": [{"sku": "a", "qty": 5}]}
    assert state.writes == {"orders": {"o1": {"items": [{"sku": "a", "qty": 5}]}}}


def test_changed_names_the_keys_a_rollout_wrote_or_deleted() -> None:
    base = {"users": {"a": {"n": 1}, "b": {"n": 2}}}
    state = RolloutState(base, {"users": {"b": {"n": 3}}}, writable=True)
    assert state.changed("users") == {"b"}
    state.put("users", "c", {"n": 4})
    state.delete("users", "a")
    assert state.changed("users") == {"a", "b", "c"}
    assert state.changed("orders") == set()


shapes_pack = Pack("shapes")
SHAPES: dict[str, Any] = {
    "tuple": (1, 2),
    "date": date(2024, 1, 2),
    "nan": float("nan"),
    "set": {1, 2},
    "int_keys": {1: "a"},
}


@shapes_pack.tool(mutates=True)
def keep(ctx: ToolContext, kind: str) -> str:
    """Keeps a record holding a value of the kind named."""
    ctx.state.put("things", kind, {"v": SHAPES[kind]})
    return "kept"


@shapes_pack.tool
def read(ctx: ToolContext, kind: str) -> str:
    """The record as the rollout's next call reads it."""
    return repr(ctx.state.get("things", kind))


async def test_a_record_reads_back_as_json_on_every_backend(app_factory: AppFactory) -> None:
    """What a tool writes is kept as JSON: the next call reads the same record from memory as from
    Redis (memory kept the tuple, the date and NaN as they were, Redis gave a list, a string and null),
    and a record JSON cannot hold fails the tool on both (Redis failed only after the tool, a 500 of
    its own; memory kept it)."""
    trace = new_trace()
    async with app_factory(packs=[shapes_pack]) as client:
        answers = {}
        for kind in SHAPES:
            kept = await client.post("/tools/keep", json=call_body({"kind": kind}, trace_id=trace))
            read_back = await client.post("/tools/read", json=call_body({"kind": kind}, trace_id=trace))
            answers[kind] = (kept.status_code, read_back.json()["output"])
    assert answers == {
        "tuple": (200, "{'v': [1, 2]}"),
        "date": (200, "{'v': '2024-01-02'}"),
        "nan": (200, "{'v': None}"),
        "set": (500, "None"),
        "int_keys": (500, "None"),
    }


def test_a_record_json_cannot_hold_names_itself() -> None:
    state = RolloutState({}, {}, writable=True)
    with pytest.raises(TypeError, match="things/k is not JSON"):
        state.put("things", "k", {"v": {1, 2}})
    assert state.writes == {}
