"""A grader that reads rollout state the store no longer holds refuses instead of scoring the base state."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio import Redis

from app.deps import app_state
from app.sdk import CheckResult, Pack, RolloutView, StateGone, ToolContext
from tests.conftest import ADMIN_KEY, REDIS_KEY_PREFIX, REDIS_URL, TOOLS_KEY, AppFactory, call_body, new_trace
from tests.grading.test_routes import GRADERS, ledger_pack, pay_call, sample, stored_grades, write_graders

STATE_GRADERS = {
    "exact": GRADERS["exact"],
    "efficient": GRADERS["efficient"],  # a multi grader with a state check inside
    "balance_tpl": {  # a template that reads the state
        "type": "string_check",
        "name": "balance_tpl",
        "operation": "eq",
        "input": "{{ rollout.state.ledger.accounts.alice.balance }}",
        "reference": "{{ item.expected_balance }}",
    },
}


async def forget_state(backend: str, trace: str) -> None:
    """What the idle TTL does in Redis; in memory, the app restart in the test does it."""
    if backend == "real":
        client = Redis.from_url(REDIS_URL)
        try:
            await client.delete(
                *[key async for key in client.scan_iter(match=f"{REDIS_KEY_PREFIX}:{{{trace}}}:*")]
            )
        finally:
            await client.aclose()


async def test_a_kept_state_is_graded_again_and_an_unkept_one_is_refused(
    app_factory: AppFactory, tmp_path: Path, backend: str
) -> None:
    """`kept` was graded (by a grader that reads no state) while its state was held: its state was kept,
    and the state graders score it after the store lost it. `late` was first graded after the state was
    gone: nothing could be kept, and the state graders refuse it. `never` was never graded."""
    graders = write_graders(tmp_path, STATE_GRADERS)
    run = f"lost-{new_trace()}"
    kept, late, never = new_trace(), new_trace(), new_trace()
    item = {"id": 1, "expected_balance": 70, "reference_answer": "70"}
    body = {"sample": sample("70"), "item": item}
    headers = {"X-Sparring-Run": run}
    async with app_factory(packs=[ledger_pack], key=ADMIN_KEY, graders_file=graders) as client:
        for t in (kept, late, never):
            await pay_call(client, t, "c1", 30, run=run)
        response = await client.post("/grade/exact", json={**body, "trace_id": kept}, headers=headers)
        assert response.json() == {"score": 1.0}
        for t in (kept, late, never):
            await forget_state(backend, t)
    # A restart: in memory, every rollout's state is gone with it.
    async with app_factory(packs=[ledger_pack], key=ADMIN_KEY, graders_file=graders) as client:
        response = await client.post("/grade/exact", json={**body, "trace_id": late}, headers=headers)
        assert response.json() == {"score": 1.0}
        grading = app_state(client.app).grading
        report = await grading.regrade("final_balance", run=run)
        assert (report.rollouts, report.skipped, report.failed, report.changed) == (2, 1, 0, 1)
        assert (report.ungraded, report.mean_before, report.mean_after) == (1, None, 1.0)
        for name in ("efficient", "balance_tpl"):
            response = await client.post(f"/grade/{name}", json={**body, "trace_id": kept})
            assert response.json() == {"score": 1.0}, (name, response.text)
            response = await client.post(f"/grade/{name}", json={**body, "trace_id": late})
            assert response.status_code == 409, (name, response.text)
            assert response.json()["error"]["code"] == "rollout_state_gone"
        grades = await stored_grades(client, run=run)
        assert [(g.trace_id, g.grader) for g in grades if g.grader != "exact"] == [
            (kept, "final_balance"),
            (kept, "efficient"),
            (kept, "balance_tpl"),
        ]
        assert all(g.score == 1.0 for g in grades), "no made-up 0 was stored"
        # A grader that reads no state is regraded as usual, whether or not the state was kept.
        plain = await grading.regrade("exact", run=run)
        assert (plain.rollouts, plain.skipped, plain.changed) == (2, 0, 0)


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_the_grade_route_refuses_too(app_factory: AppFactory, tmp_path: Path) -> None:
    graders = write_graders(tmp_path, STATE_GRADERS)
    trace = new_trace()
    async with app_factory(packs=[ledger_pack], key=ADMIN_KEY, graders_file=graders) as client:
        await pay_call(client, trace, "c1", 30)
    async with app_factory(packs=[ledger_pack], key=ADMIN_KEY, graders_file=graders) as client:
        response = await client.post(
            "/grade/final_balance",
            json={"sample": sample("70"), "item": {"expected_balance": 70}, "trace_id": trace},
        )
        assert response.status_code == 409, response.text
        assert "state" in response.json()["error"]["message"]
        assert await stored_grades(client, trace) == []


box_pack = Pack("box", base=lambda resources: {"accounts": {"alice": {"balance": 100}}})


@box_pack.tool(mutates=True)
def spend(ctx: ToolContext, amount: int) -> str:
    """Take `amount` from alice's balance."""
    account = ctx.state.get("accounts", "alice")
    account["balance"] -= amount
    ctx.state.put("accounts", "alice", account)
    return "ok"


@box_pack.state_check("live_box")
def live_box(view: RolloutView) -> CheckResult:
    """Reads something of the rollout that lives outside its state (a live process, say): gone here."""
    if view.item.get("box_alive"):
        return CheckResult(score=1.0)
    raise StateGone("the rollout's box stopped")


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_check_raising_state_gone_is_refused_not_scored(app_factory: AppFactory) -> None:
    """Any pack's check can refuse (StateGone): 409 with its reason, no grade stored; alive, it scores."""
    trace = new_trace()
    async with app_factory(packs=[box_pack], key=ADMIN_KEY) as client:
        response = await client.post(
            "/tools/spend",
            json={
                "type": "function_call",
                "call_id": "c1",
                "name": "spend",
                "arguments": '{"amount": 5}',
                "trace_id": trace,
            },
        )
        assert response.status_code == 200, response.text
        gone = await client.post("/grade/live_box", json={"sample": {}, "item": {}, "trace_id": trace})
        assert await stored_grades(client, trace) == []
        alive = await client.post(
            "/grade/live_box", json={"sample": {}, "item": {"box_alive": True}, "trace_id": trace}
        )
    assert gone.status_code == 409, gone.text
    assert gone.json()["error"]["code"] == "rollout_state_gone"
    assert "the rollout's box stopped" in gone.json()["error"]["message"]
    assert alive.json() == {"score": 1.0}


@pytest.mark.parametrize(
    "arguments", [{"amount": "not a number"}, {}], ids=["invalid-arguments", "missing-arguments"]
)
async def test_a_rollout_whose_state_calls_all_failed_is_graded_on_the_base_state(
    app_factory: AppFactory, tmp_path: Path, arguments: dict[str, object]
) -> None:
    """Its calls of a state tool were refused before they reached the store, which so never saw the
    rollout: nothing expired, and it is graded as the model left it (the base state), not refused (a
    409 makes the trainer drop the rollout, and a model that only makes invalid calls escape its 0)."""
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    trace = new_trace()
    async with app_factory(packs=[ledger_pack], key=ADMIN_KEY, graders_file=graders) as client:
        call = await client.post(
            "/tools/pay",
            json=call_body(arguments, trace_id=trace, call_id="c1"),
            headers={"Authorization": f"Bearer {TOOLS_KEY}"},
        )
        response = await client.post(
            "/grade/final_balance",
            json={"sample": sample("done"), "item": {"expected_balance": 100}, "trace_id": trace},
        )
    assert call.json()["output"].startswith("Error: invalid arguments")
    assert response.status_code == 200, response.text
    assert response.json() == {"score": 1.0}
