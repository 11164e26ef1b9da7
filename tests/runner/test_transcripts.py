"""sparring keeps the conversation of every rollout it runs itself: canaries here (eval: test_retail.py)."""

from __future__ import annotations

from pathlib import Path

from sparring.session import RunOptions, run_canaries
from tests.conftest import AppFactory
from tests.runner.conftest import NO_WAIT, admin_get, target, write_graders
from tests.runner.test_loop import GRADERS, counter_line


async def test_each_canary_rollout_keeps_its_conversation_named_by_its_canary(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        report = await run_canaries(
            client,
            target("says"),
            [counter_line("101")],
            RunOptions(run="kept", retry=NO_WAIT),
            policies=["parrot", "loop"],
        )
        by_policy = {
            r["policy"]: await admin_get(client, f"/rollouts/{r['trace_id']}") for r in report["rollouts"]
        }
    parrot, looping = by_policy["parrot"]["transcript"], by_policy["loop"]["transcript"]
    assert parrot["model"] == "canary:parrot" and parrot["source"] == "canary"
    # The parrot answers with the user's words at once; the loop's calls are the logged calls.
    assert [m["role"] for m in parrot["messages"]] == ["system", "user", "assistant"]
    assert parrot["messages"][-1]["content"] == parrot["messages"][1]["content"]
    asked = [c["call_id"] for m in looping["messages"] if m["role"] == "assistant" for c in m["tool_calls"]]
    assert asked and asked == [c["call_id"] for c in by_policy["loop"]["timeline"]]
    answered = [m["call_id"] for m in looping["messages"] if m["role"] == "tool"]
    assert answered == asked
