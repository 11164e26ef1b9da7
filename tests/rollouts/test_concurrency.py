"""Parallel and retried calls on one process: locks, the call ledger, the log, and reading rollouts back.

Every test runs on the embedded backend (SQLite + memory), on the real one (Postgres + Redis) and on
Postgres with a local Redis Cluster.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any

import httpx
import orjson
import pytest

from app.deps import app_state
from app.sdk import Pack, ToolContext
from tests.call_log import logged_calls_on
from tests.conftest import ADMIN_KEY, CLUSTER_BACKENDS, AppFactory, call_body, new_trace
from tests.packs import counter_pack, faults_pack

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BASE_VALUE = 100  # tests.packs.counter_pack starts its counter here


@pytest.fixture(params=CLUSTER_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# --- a pack whose tools wait on gates the test opens, so "while the lock is held" is exact -----------

_gates: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}


def gate(key: str) -> tuple[asyncio.Event, asyncio.Event]:
    """(entered, release): the tool sets `entered` and then waits for the test to set `release`."""
    _gates[key] = (asyncio.Event(), asyncio.Event())
    return _gates[key]


async def _pass_gate(key: str) -> None:
    entered, release = _gates[key]
    entered.set()
    await asyncio.wait_for(release.wait(), 10)


probe_pack = Pack(
    "probe",
    base=lambda resources: {"items": {"a": {"n": 1}, "b": {"n": 2}, "c": {"n": 3}}},
)


@probe_pack.tool(mutates=True)
async def hold(ctx: ToolContext, key: str) -> str:
    """Change state, but only once the test opens the gate (holds the rollout's lock meanwhile)."""
    ctx.state.put("items", f"held-{key}", {"n": 0})
    await _pass_gate(key)
    return "held"


@probe_pack.tool
async def wait_here(key: str) -> str:
    """A read-only call that returns once the test opens its gate."""
    await _pass_gate(key)
    return f"passed {key}"


@probe_pack.tool(mutates=True)
def set_item(ctx: ToolContext, key: str, n: int) -> dict[str, int]:
    """Set an item."""
    ctx.state.put("items", key, {"n": n})
    return {"n": n}


@probe_pack.tool(mutates=True)
def delete_item(ctx: ToolContext, key: str) -> str:
    """Delete an item."""
    ctx.state.delete("items", key)
    return "deleted"


@probe_pack.tool(mutates=True)
def set_unstorable(ctx: ToolContext, kind: str) -> str:
    """Write a record that is not JSON (a set, a number as a key, an integer beyond 64 bits)."""
    values: dict[str, Any] = {"set": {1, 2}, "number_key": {1: "one"}, "wide": 2**70}
    ctx.state.put("items", "a", {"n": values[kind]})
    return "written"


PACKS = [counter_pack, faults_pack, probe_pack]


# --- helpers --------------------------------------------------------------------------------------


async def post_answered(client: httpx.AsyncClient, tool: str, body: dict[str, Any]) -> tuple[str, int]:
    """POST like the trainer does: a 503 is retried (same body) a bounded number of times.

    Returns the output of the 200 answer and how many 503s preceded it.
    """
    unavailable = 0
    for _ in range(20):
        response = await client.post(f"/tools/{tool}", json=body)
        if response.status_code == 200:
            return response.json()["output"], unavailable
        assert response.status_code == 503, (response.status_code, response.text)
        assert response.headers.get("Retry-After"), "a 503 must say when to retry"
        unavailable += 1
        await asyncio.sleep(0.05)
    raise AssertionError(f"{tool} {body.get('call_id')} was never answered")


async def logged_calls(client: httpx.AsyncClient, traces: list[str]) -> list[dict[str, Any]]:
    """Rows of tool_calls for these rollouts, read through the app's own engine."""
    return await logged_calls_on(app_state(client.app).engine, traces)  # type: ignore[attr-defined]


def value_of(output: str) -> int:
    return int(orjson.loads(output)["value"])


async def read_counter(client: httpx.AsyncClient, trace: str, name: str = "main") -> int:
    r = await client.post("/tools/read_counter", json=call_body({"name": name}, trace_id=trace))
    assert r.status_code == 200, r.text
    return value_of(r.json()["output"])


# --- 200 rollouts at once -------------------------------------------------------------------------

ROLLOUTS = 200
STEPS = (1, 2, 4, 8, 16)  # `by` of each distinct call; every subset has a distinct sum


async def _rollout(client: httpx.AsyncClient, trace: str, rng: random.Random) -> dict[str, Any]:
    """One rollout: a parallel batch with concurrent duplicates, late retries, then one more call."""
    sent: dict[str, list[str]] = defaultdict(list)  # call_id -> every answer received for it
    by_of = {f"call_{i}": by for i, by in enumerate(STEPS)}
    unavailable = 0

    async def send(call_id: str) -> None:
        nonlocal unavailable
        body = call_body(
            orjson.dumps({"by": by_of[call_id]}).decode(), trace_id=trace, call_id=call_id, id=f"fc_{call_id}"
        )
        output, n503 = await post_answered(client, "increment", body)
        unavailable += n503
        sent[call_id].append(output)

    # The model's parallel batch: four calls at once, two of them duplicated while the original runs.
    batch = ["call_0", "call_1", "call_2", "call_3"]
    duplicates = rng.sample(batch, 2)
    jobs: list[Awaitable[None]] = [send(c) for c in batch] + [send(c) for c in duplicates]
    rng.shuffle(jobs)  # type: ignore[arg-type]
    await asyncio.gather(*jobs)
    # The trainer retrying after the fact (one call twice at once, another once).
    late = rng.sample(batch, 2)
    await asyncio.gather(send(late[0]), send(late[0]), send(late[1]))
    # The next turn, and its retry.
    await send("call_4")
    await send("call_4")
    return {"trace": trace, "sent": sent, "by": by_of, "unavailable": unavailable}


@pytest.mark.slow
async def test_200_concurrent_rollouts_no_lost_or_double_update(app_factory: AppFactory) -> None:
    rng = random.Random(1234)
    async with app_factory(packs=PACKS) as client:
        traces = [new_trace() for _ in range(ROLLOUTS)]
        results = await asyncio.wait_for(
            asyncio.gather(*(_rollout(client, t, random.Random(rng.random())) for t in traces)), 150
        )
        finals = await asyncio.gather(*(read_counter(client, t) for t in traces))
        rows = await logged_calls(client, traces)

    expected_final = BASE_VALUE + sum(STEPS)
    by_key = defaultdict(list)
    for row in rows:
        by_key[(row["trace_id"], row["call_id"])].append(row)

    for result, final in zip(results, finals, strict=True):
        trace, sent, by_of = result["trace"], result["sent"], result["by"]
        # No lost update, no double application: every distinct call applied exactly once.
        assert final == expected_final, f"{trace}: counter {final}, expected {expected_final}"
        # Retries and duplicates got the identical answer.
        for call_id, outputs in sent.items():
            assert len(set(outputs)) == 1, f"{trace} {call_id}: different answers {outputs}"
        # The answers are those of some serial order: sorted by value, each adds its own `by`.
        answers = sorted((value_of(outputs[0]), call_id) for call_id, outputs in sent.items())
        previous = BASE_VALUE
        for value, call_id in answers:
            assert value - previous == by_of[call_id], f"{trace}: answers {answers} are not serializable"
            previous = value
        # Every answered call is in the log, once, with the output that was sent.
        for call_id, outputs in sent.items():
            answered = [r for r in by_key[(trace, call_id)] if r["status_code"] == 200]
            assert len(answered) == 1, f"{trace} {call_id}: {len(answered)} answered rows in the log"
            assert answered[0]["output"] == outputs[0]
            assert answered[0]["outcome"] == "ok" and answered[0]["tool"] == "increment"
    # A 503 (with Retry-After, checked in post_answered) is allowed: one process saturated by ~2000
    # simultaneous requests sheds load when its Redis pool is exhausted; the retry must then be exact.


# --- locks ----------------------------------------------------------------------------------------


async def test_read_only_tools_do_not_wait_for_a_held_lock(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        trace, other = new_trace(), new_trace()
        assert value_of((await post_answered(client, "increment", call_body("{}", trace_id=trace)))[0]) == 101
        key = uuid.uuid4().hex
        entered, release = gate(key)
        holder = asyncio.create_task(
            client.post("/tools/hold", json=call_body({"key": key}, trace_id=trace, call_id="h"))
        )
        try:
            await asyncio.wait_for(entered.wait(), 10)
            # The lock is held now. A read-only tool answers at once, and sees only committed state.
            read = await asyncio.wait_for(
                client.post("/tools/read_counter", json=call_body("{}", trace_id=trace, call_id="r")), 5
            )
            assert read.status_code == 200 and value_of(read.json()["output"]) == 101
            # Another rollout's mutating call does not wait either.
            elsewhere = await asyncio.wait_for(
                client.post("/tools/increment", json=call_body("{}", trace_id=other, call_id="i")), 5
            )
            assert elsewhere.status_code == 200 and value_of(elsewhere.json()["output"]) == 101
            # A mutating call of the same rollout waits for the lock.
            blocked = asyncio.create_task(
                client.post("/tools/increment", json=call_body("{}", trace_id=trace, call_id="i2"))
            )
            await asyncio.sleep(0.3)
            assert not blocked.done(), "a mutating call ran while another held the rollout's lock"
        finally:
            release.set()
        held = await asyncio.wait_for(holder, 10)
        assert held.status_code == 200 and held.json()["output"] == "held"
        after = await asyncio.wait_for(blocked, 10)
        assert after.status_code == 200 and value_of(after.json()["output"]) == 102


# --- what changes and what does not ---------------------------------------------------------------


async def test_tool_error_after_a_write_leaves_state_unchanged(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()
        await post_answered(client, "increment", call_body('{"by": 5}', trace_id=trace, call_id="c1"))
        r = await client.post(
            "/tools/increment_then_fail", json=call_body("{}", trace_id=trace, call_id="c2")
        )
        assert r.status_code == 200
        assert r.json()["output"] == "Error: refused after writing"
        assert await read_counter(client, trace) == 105
        state = (await client.get(f"/rollouts/{trace}/state", headers=ADMIN)).json()
        assert state["packs"]["counter"]["state"]["counters"]["main"] == {"value": 105}
        changed = (await client.get(f"/rollouts/{trace}/state?changed_only=true", headers=ADMIN)).json()
        assert changed["packs"]["counter"] == {"changed": {"counters": {"main": {"value": 105}}}}
        # The refusal is remembered like any answer: a retry replays it without running the tool.
        again = await client.post(
            "/tools/increment_then_fail", json=call_body("{}", trace_id=trace, call_id="c2")
        )
        assert again.json()["output"] == r.json()["output"]
        rows = [r for r in await logged_calls(client, [trace]) if r["call_id"] == "c2"]
        assert [(r["outcome"], r["status_code"]) for r in rows] == [("model_error", 200)]


@pytest.mark.parametrize("kind", ["set", "number_key", "wide"])
async def test_a_write_no_store_keeps_is_a_tool_crash_on_every_backend(
    app_factory: AppFactory, kind: str
) -> None:
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()
        body = call_body({"kind": kind}, trace_id=trace, call_id="c1")
        for _ in range(2):  # not an answer: the retry runs the tool again, and crashes again
            r = await client.post("/tools/set_unstorable", json=body)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "tool_crashed"
        rows = await logged_calls(client, [trace])
        assert [(r["outcome"], r["status_code"]) for r in rows] == [("tool_crash", 500)] * 2
        changed = (await client.get(f"/rollouts/{trace}/state?changed_only=true", headers=ADMIN)).json()
        assert changed["packs"] == {}  # nothing was kept


async def test_a_counter_past_64_bits_fails_alike_on_every_backend(app_factory: AppFactory) -> None:
    """Each `by` is a 64-bit integer the arguments take; their sum is not, and no store keeps it."""
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()
        for i in range(3):
            body = call_body({"by": 2**62}, trace_id=trace, call_id=f"c{i}")
            await post_answered(client, "increment", body)
        r = await client.post("/tools/increment", json=call_body({"by": 2**62}, trace_id=trace, call_id="c3"))
        assert r.status_code == 500 and r.json()["error"]["code"] == "tool_crashed", r.text
        assert await read_counter(client, trace) == BASE_VALUE + 3 * 2**62


async def test_calls_without_call_id_are_not_deduplicated(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()
        body = call_body('{"by": 3}', trace_id=trace)  # no call_id: each delivery is a new call
        first = await client.post("/tools/increment", json=body)
        second = await client.post("/tools/increment", json=body)
        assert [value_of(first.json()["output"]), value_of(second.json()["output"])] == [103, 106]
        # The same call_id in another rollout is a different call.
        a, b = new_trace(), new_trace()
        ra = await client.post("/tools/increment", json=call_body('{"by": 2}', trace_id=a, call_id="same"))
        rb = await client.post("/tools/increment", json=call_body('{"by": 2}', trace_id=b, call_id="same"))
        assert value_of(ra.json()["output"]) == value_of(rb.json()["output"]) == 102
        assert await read_counter(client, trace) == 106
        rows = await logged_calls(client, [trace])
        increments = [r for r in rows if r["tool"] == "increment"]
        assert len(increments) == 2 and all(r["call_id"] is None for r in increments)
        assert sorted(r["output"] for r in increments) == sorted(
            [first.json()["output"], second.json()["output"]]
        )


async def test_graded_rollouts_refuse_mutating_calls(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()
        await post_answered(client, "increment", call_body('{"by": 7}', trace_id=trace, call_id="c1"))
        await app_state(client.app).store.mark_graded(trace)  # type: ignore[attr-defined]
        r = await client.post("/tools/increment", json=call_body('{"by": 1}', trace_id=trace, call_id="c2"))
        assert r.status_code == 200
        output = r.json()["output"]
        assert output.startswith("Error:") and "graded" in output
        r = await client.post("/tools/set_item", json=call_body('{"key": "a", "n": 9}', trace_id=trace))
        assert r.status_code == 200 and "graded" in r.json()["output"]
        # Reading still works, and nothing changed.
        assert await read_counter(client, trace) == 107
        state = (await client.get(f"/rollouts/{trace}/state", headers=ADMIN)).json()
        assert "probe" not in state["packs"]
        # A retry of a call answered before grading still gets its original answer.
        replay = await client.post(
            "/tools/increment", json=call_body('{"by": 7}', trace_id=trace, call_id="c1")
        )
        assert value_of(replay.json()["output"]) == 107
        rows = {r["call_id"]: r for r in await logged_calls(client, [trace]) if r["call_id"]}
        assert rows["c2"]["outcome"] == "model_error" and rows["c2"]["output"] == output
        # Other rollouts are not affected.
        assert (
            value_of((await post_answered(client, "increment", call_body("{}", trace_id=new_trace())))[0])
            == 101
        )


# --- reading rollouts back ------------------------------------------------------------------------


async def test_parallel_batches_are_marked(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()

        async def parallel(call_ids: list[str]) -> None:
            gates = {c: gate(f"{trace}-{c}") for c in call_ids}
            tasks = [
                asyncio.create_task(
                    client.post(
                        "/tools/wait_here", json=call_body({"key": f"{trace}-{c}"}, trace_id=trace, call_id=c)
                    )
                )
                for c in call_ids
            ]
            # Every call of the batch is inside the tool before any is let go: they overlap for sure.
            await asyncio.wait_for(asyncio.gather(*(entered.wait() for entered, _ in gates.values())), 10)
            for _, release in gates.values():
                release.set()
            responses = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            assert all(r.status_code == 200 for r in responses)

        await parallel(["p1", "p2", "p3"])
        await post_answered(client, "increment", call_body("{}", trace_id=trace, call_id="s1"))
        await parallel(["q1", "q2"])
        await post_answered(client, "read_counter", call_body("{}", trace_id=trace, call_id="s2"))

        r = await client.get(f"/rollouts/{trace}", headers=ADMIN)
        assert r.status_code == 200, r.text
        detail = r.json()
        timeline = detail["timeline"]
        assert [c["seq"] for c in timeline] == list(range(7))
        batch_of = {c["call_id"]: c["batch"] for c in timeline}
        assert batch_of["p1"] == batch_of["p2"] == batch_of["p3"] == 0
        assert batch_of["s1"] == 1
        assert batch_of["q1"] == batch_of["q2"] == 2
        assert batch_of["s2"] == 3
        assert detail["parallel_batches"] == 4 and detail["call_count"] == 7
        # The machines' path answers the review's detail: one shape, one read.
        assert detail == (await client.get(f"/review/api/rollouts/{trace}", headers=ADMIN)).json()
        assert [c["call_id"] for c in timeline][3] == "s1"
        assert all(c["outcome"] == "ok" and c["status_code"] == 200 for c in timeline)

        # The review routes need an admin key; the tools key is refused.
        assert (await client.get(f"/rollouts/{trace}")).status_code == 403
        assert (await client.get(f"/rollouts/{new_trace()}", headers=ADMIN)).status_code == 404


async def test_state_route_materializes_base_and_changes(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        trace = new_trace()
        never_seen = await client.get(f"/rollouts/{trace}/state", headers=ADMIN)
        assert never_seen.status_code == 404
        for tool, args in [
            ("set_item", {"key": "b", "n": 20}),
            ("set_item", {"key": "d", "n": 4}),
            ("delete_item", {"key": "c"}),
            ("increment", {"by": 5}),
            ("increment", {"by": 1, "name": "other"}),
        ]:
            await post_answered(client, tool, call_body(args, trace_id=trace, call_id=uuid.uuid4().hex))
        r = await client.get(f"/rollouts/{trace}/state", headers=ADMIN)
        assert r.status_code == 200, r.text
        packs = r.json()["packs"]
        assert packs["probe"]["state"] == {"items": {"a": {"n": 1}, "b": {"n": 20}, "d": {"n": 4}}}
        assert packs["probe"]["changed"] == {"items": {"b": {"n": 20}, "c": None, "d": {"n": 4}}}
        assert packs["counter"]["state"] == {"counters": {"main": {"value": 105}, "other": {"value": 1}}}
        # Another rollout still sees the untouched base.
        other = new_trace()
        await post_answered(client, "increment", call_body("{}", trace_id=other, call_id="x"))
        packs = (await client.get(f"/rollouts/{other}/state", headers=ADMIN)).json()["packs"]
        assert packs == {
            "counter": {
                "changed": {"counters": {"main": {"value": 101}}},
                "state": {"counters": {"main": {"value": 101}}},
            }
        }


async def test_rollout_list_filters_by_run_header(app_factory: AppFactory) -> None:
    async with app_factory(packs=PACKS) as client:
        run_a, run_b = f"run-a-{uuid.uuid4().hex[:8]}", f"run-b-{uuid.uuid4().hex[:8]}"
        traces_a, traces_b, unlabeled = (
            [new_trace() for _ in range(3)],
            [new_trace() for _ in range(2)],
            new_trace(),
        )
        for trace, run in (
            [(t, run_a) for t in traces_a] + [(t, run_b) for t in traces_b] + [(unlabeled, None)]
        ):
            headers = {"X-Sparring-Run": run} if run else {}
            for i in range(2):
                r = await client.post(
                    "/tools/read_counter",
                    json=call_body("{}", trace_id=trace, call_id=f"c{i}", item={"id": f"item-{trace}"}),
                    headers=headers,
                )
                assert r.status_code == 200
        # GET /rollouts is the review's rollout list (the same query path as /review/api/rollouts).
        listed_a = (await client.get("/rollouts", params={"run": run_a, "limit": 100}, headers=ADMIN)).json()
        listed_b = (await client.get("/rollouts", params={"run": run_b}, headers=ADMIN)).json()
        reviewed_a = await client.get(
            "/review/api/rollouts", params={"run": run_a, "limit": 100}, headers=ADMIN
        )
        assert listed_a == reviewed_a.json()
        assert sorted(r["trace_id"] for r in listed_a["rollouts"]) == sorted(traces_a)
        assert sorted(r["trace_id"] for r in listed_b["rollouts"]) == sorted(traces_b)
        assert all(r["run"] == run_a and r["call_count"] == 2 for r in listed_a["rollouts"])
        assert all(r["item_key"] == f"id:item-{r['trace_id']}" for r in listed_a["rollouts"])
        # Most recent first.
        assert [r["trace_id"] for r in listed_a["rollouts"]] == list(reversed(traces_a))
        everything = (await client.get("/rollouts", params={"limit": 500}, headers=ADMIN)).json()
        assert unlabeled in {r["trace_id"] for r in everything["rollouts"]}
        limited = (await client.get("/rollouts", params={"limit": 2}, headers=ADMIN)).json()
        assert len(limited["rollouts"]) == 2 and limited["next_cursor"] is not None
        assert (await client.get("/rollouts", params={"run": run_a})).status_code == 403
