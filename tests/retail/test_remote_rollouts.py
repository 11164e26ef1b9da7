"""Remote rollouts of retail tasks: a model playing the gold calls gets reward 1.0, graded at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ADMIN_KEY, AppFactory
from tests.remote.model_server import ModelServer, Turn
from tests.remote.processor import Row, init_request, post_init, wait_terminated
from tests.retail.corpus import build_dataset, replay_calls
from tests.retail.gold import gold_turns
from tools.retail import pack

TASKS = 4


@pytest.fixture(scope="module")
def lines() -> list[dict[str, object]]:
    return build_dataset("train")[:TASKS]


@pytest.fixture(scope="module")
def model(lines: list[dict[str, object]]) -> Iterator[ModelServer]:
    server = ModelServer()
    for line in lines:
        task_id = str(line["task_id"])
        server.scripts[f"gold-{task_id}"] = gold_turns(task_id)
        server.scripts[f"silent-{task_id}"] = [Turn(text="I cannot help with that.")]
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_gold_rollouts_finish_with_reward_one_and_shortcuts_with_zero(
    app_factory: AppFactory, model: ModelServer, lines: list[dict[str, object]], retail_data: Path
) -> None:
    gold = {str(line["task_id"]): Row.new() for line in lines}
    silent = {str(line["task_id"]): Row.new() for line in lines}
    async with app_factory(
        packs=[pack],
        remote_grader="retail",
        pack_settings={"retail": {"data": retail_data}},
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        bodies = []
        for line in lines:
            task_id = str(line["task_id"])
            item = {k: v for k, v in line.items() if k not in ("messages", "tools")}
            for prefix, rows in (("gold", gold), ("silent", silent)):
                bodies.append(
                    init_request(
                        rows[task_id],
                        model=f"{prefix}-{task_id}",
                        model_base_url=model.base_url(),
                        messages=line["messages"],  # type: ignore[arg-type]
                        tools=line["tools"],  # type: ignore[arg-type]
                        item=item,
                    )
                )
        accepted = await asyncio.gather(*(post_init(client, "/remote", body) for body in bodies))
        assert {a.status_code for a in accepted} == {200}
        for task_id, row in gold.items():
            status = await wait_terminated(client, "/remote", row.rollout_id)
            assert status["state"] == "finished", status
            assert status["reward"] == 1.0, (task_id, status)
            assert status["info"]["grader"] == "retail"
            timeline = await client.get(
                f"/rollouts/{status['trace_id']}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            )
            logged = [c["tool"] for c in timeline.json()["timeline"]]
            assert sorted(logged) == sorted(name for name, _ in replay_calls(task_id))
            assert timeline.json()["graded_at"] is not None
        for row in silent.values():
            status = await wait_terminated(client, "/remote", row.rollout_id)
            assert status["state"] == "finished" and status["reward"] == 0.0


async def test_without_the_item_a_rollout_is_not_graded(
    app_factory: AppFactory, model: ModelServer, lines: list[dict[str, object]], retail_data: Path
) -> None:
    line, row = lines[0], Row.new()
    async with app_factory(
        packs=[pack],
        remote_grader="retail",
        pack_settings={"retail": {"data": retail_data}},
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        body = init_request(
            row,
            model=f"gold-{line['task_id']}",
            model_base_url=model.base_url(),
            messages=line["messages"],  # type: ignore[arg-type]
            pack="retail",
        )
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "finished"
    assert status["reward"] is None and status["info"]["grader"] is None
    assert status["info"]["tool_calls"] == len(replay_calls(str(line["task_id"])))
