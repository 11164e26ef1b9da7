"""`evaluate` end to end on the retail pack (Postgres + Redis), through `openai`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from sparring.evaluate import Journal, line_key
from sparring.loop import DatasetLine
from sparring.policies import make_policy
from sparring.session import RunOptions, evaluate
from tests.conftest import ADMIN_KEY, AppFactory
from tests.retail.conftest import HOME
from tests.retail.corpus import build_dataset, gold_calls, replay
from tests.runner.conftest import NO_WAIT, Outage, admin_get, target
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply
from tools.retail import data, pack

APIS = ["responses", "chat"]


@pytest.fixture(scope="module")
def retail_data() -> Path:
    return data.DATA.fetch(data.DATA.cache_dir(HOME))


@pytest.fixture(scope="module")
def train(retail_data: Path) -> list[dict[str, Any]]:
    return build_dataset("train")


def lines_of(raw: list[dict[str, Any]]) -> list[DatasetLine]:
    return [DatasetLine.from_json(line) for line in raw]


def with_writes_and_facts(train: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Tasks whose gold calls change the database and that have facts to communicate: none is
    solvable by accident."""
    chosen = [
        line
        for line in train
        if line["communicate_info"] and any(replay(gold_calls(line["task_id"])).changes.values())
    ]
    return chosen[:count]


class GoldModel:
    """Plays each task's gold calls one per turn, then states the facts to communicate. `immediate` lists
    the rollouts (by user message, in order of their first turn) that answer at once instead."""

    def __init__(self, raw: list[dict[str, Any]], immediate: dict[str, set[int]] | None = None) -> None:
        self.by_user = {line["messages"][-1]["content"]: line for line in raw}
        self.immediate = immediate or {}
        self.started: Counter[str] = Counter()

    def __call__(self, request: ModelRequest) -> Reply:
        line = self.by_user[request.user]
        task = line["task_id"]
        if not request.outputs:
            index = self.started[task]
            self.started[task] += 1
            if index in self.immediate.get(task, set()):
                return Reply(text="I have taken care of everything.")
        actions = line["actions"]
        done = len(request.outputs)
        if done < len(actions):
            return Reply(calls=(Call(actions[done]["name"], actions[done]["arguments"]),))
        return Reply(text="Done. " + " and ".join(line["communicate_info"]))


def options(run: str, tmp_path: Path, **overrides: Any) -> RunOptions:
    values: dict[str, Any] = {
        "run": run,
        "concurrency": 4,
        "journal": tmp_path / f"{run}.jsonl",
        "retry": NO_WAIT,
    }
    values.update(overrides)
    return RunOptions(**values)


@pytest.mark.parametrize("api", APIS)
async def test_a_model_playing_the_gold_calls_scores_1_and_its_calls_are_logged_in_order(
    api: str,
    app_factory: AppFactory,
    retail_data: Path,
    train: list[dict[str, Any]],
    tmp_path: Path,
    model_server: ModelServer,
    openai_client: AsyncOpenAI,
) -> None:
    raw = with_writes_and_facts(train, 3)
    model_server.script = GoldModel(raw)
    run = f"gold-{api}"
    opts = options(run, tmp_path, model="scripted")
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"retail": {"data": retail_data}}
    ) as client:
        report = await evaluate(
            client, target("retail"), lines_of(raw), lambda: make_policy(api, openai_client, "scripted"), opts
        )
        records = Journal(tmp_path / f"{run}.jsonl").load()
        logged = {r.item_key: await admin_get(client, f"/rollouts/{r.trace_id}") for r in records}

    assert report["rollouts"]["graded"] == 3 and report["rollouts"]["discarded"] == 0
    assert report["reward"]["mean"] == 1.0
    assert report["review_url"] == f"http://sparring/review/run?name={run}"
    for line in raw:
        timeline = logged[f"task_id:{line['task_id']}"]["timeline"]
        # The run stored each rollout's conversation: every call the model asked for is a logged call.
        transcript = logged[f"task_id:{line['task_id']}"]["transcript"]
        assert transcript["model"] == "scripted" and transcript["source"] == "eval"
        asked = [
            c["call_id"] for m in transcript["messages"] if m["role"] == "assistant" for c in m["tool_calls"]
        ]
        assert asked == [c["call_id"] for c in timeline]
        assert transcript["messages"][-1]["content"].startswith("Done. ")
        assert [(c["tool"], json.loads(c["arguments"])) for c in timeline] == [
            (a["name"], a["arguments"]) for a in line["actions"]
        ]
        # Each call was answered as replaying the gold calls on a fresh store answers it.
        expected = [
            "ok" if r.error is None else "model_error" for r in replay(gold_calls(line["task_id"])).results
        ]
        assert [c["outcome"] for c in timeline] == expected
    expected_calls = sum(len(line["actions"]) for line in raw)
    gold_errors = sum(
        r.error is not None for line in raw for r in replay(gold_calls(line["task_id"])).results
    )
    assert report["tool_calls"] == expected_calls and report["tool_errors"] == gold_errors
    turns = expected_calls + len(raw)
    assert report["tokens"]["input"] == 11 * turns and report["tokens"]["output"] == 7 * turns


async def test_the_report_matches_the_review_api_and_names_items_without_signal(
    app_factory: AppFactory,
    retail_data: Path,
    train: list[dict[str, Any]],
    tmp_path: Path,
    model_server: ModelServer,
    openai_client: AsyncOpenAI,
) -> None:
    mixed, solved, unsolved = with_writes_and_facts(train, 3)
    model_server.script = GoldModel(
        [mixed, solved, unsolved], immediate={mixed["task_id"]: {1}, unsolved["task_id"]: {0, 1}}
    )
    run = "baseline-mixed"
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"retail": {"data": retail_data}}
    ) as client:
        report = await evaluate(
            client,
            target("retail"),
            lines_of([mixed, solved, unsolved]),
            lambda: make_policy("chat", openai_client, "scripted"),
            options(run, tmp_path, samples=2),
        )
        stats = await admin_get(client, f"/review/api/stats?run={run}")
        items = await admin_get(client, f"/review/api/items?run={run}&order=item")

    key = {line["task_id"]: f"task_id:{line['task_id']}" for line in (mixed, solved, unsolved)}
    assert report["rollouts"]["graded"] == 6
    assert report["reward"]["mean"] == pytest.approx(0.5)
    assert report["items"]["always_one"] == [key[solved["task_id"]]]
    assert report["items"]["always_zero"] == [key[unsolved["task_id"]]]
    assert report["items"]["share_always_zero"] == pytest.approx(1 / 3)
    per_item = {entry["item"]: entry for entry in report["items"]["per_item"]}
    assert per_item[key[mixed["task_id"]]]["mean"] == 0.5
    assert per_item[key[mixed["task_id"]]]["variance"] == 0.25

    # The review pages show the same run.
    assert stats["rollouts"] == 6 and stats["reward"]["scored"] == 6
    assert stats["reward"]["mean"] == pytest.approx(report["reward"]["mean"])
    assert stats["reward"]["std"] == pytest.approx(report["reward"]["std"])
    assert stats["items"]["share_always_zero"] == pytest.approx(report["items"]["share_always_zero"])
    assert stats["items"]["share_always_one"] == pytest.approx(report["items"]["share_always_one"])
    reviewed = {entry["item_key"]: (entry["mean"], entry["variance"]) for entry in items["items"]}
    assert reviewed == {k: (v["mean"], v["variance"]) for k, v in per_item.items()}
    # Calls per rollout: the review counts answered calls of the run's rollouts.
    calls = sum(
        n * c
        for n, c in zip(
            stats["calls_per_rollout"]["values"], stats["calls_per_rollout"]["counts"], strict=True
        )
    )
    assert calls == report["tool_calls"]


async def test_503_three_times_discards_and_resume_runs_only_what_is_missing(
    app_factory: AppFactory,
    retail_data: Path,
    train: list[dict[str, Any]],
    tmp_path: Path,
    model_server: ModelServer,
    openai_client: AsyncOpenAI,
) -> None:
    raw = with_writes_and_facts(train, 3)
    # A tool only the first task calls: an outage of it discards exactly that task's rollout.
    uses = [{a["name"] for a in line["actions"]} for line in raw]
    only_first = sorted(uses[0] - uses[1] - uses[2])
    assert only_first, "pick tasks where one tool is used by the first task only"
    model_server.script = GoldModel(raw)
    run = "resumable"
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"retail": {"data": retail_data}}
    ) as app_client:
        outage = Outage(app_client._transport, failures=3, tool=only_first[0])
        async with httpx.AsyncClient(transport=outage, base_url="http://sparring") as client:
            first = await evaluate(
                client,
                target("retail"),
                lines_of(raw),
                lambda: make_policy("responses", openai_client, "scripted"),
                options(run, tmp_path),
            )
        assert set(outage.attempts.values()) == {3}
        started_before = sum(model_server.script.started.values())  # type: ignore[attr-defined]

        # Resume with two samples per item: the discarded rollout and every second sample run, nothing else.
        second = await evaluate(
            app_client,
            target("retail"),
            lines_of(raw),
            lambda: make_policy("responses", openai_client, "scripted"),
            options(run, tmp_path, samples=2, resume=True),
        )
        stats = await admin_get(app_client, f"/review/api/stats?run={run}")

    assert first["rollouts"]["discarded"] == 1 and first["rollouts"]["graded"] == 2
    assert first["rollouts"]["discarded_by_reason"] == {"tool_failed": 1}
    assert first["reward"]["mean"] == 1.0
    assert sum(model_server.script.started.values()) - started_before == 4  # type: ignore[attr-defined]
    assert second["rollouts"]["resumed"] == 2 and second["rollouts"]["run"] == 6
    assert second["rollouts"]["graded"] == 6 and second["rollouts"]["discarded"] == 0
    assert second["reward"]["mean"] == 1.0
    assert stats["reward"]["scored"] == 6
    journal = Journal(tmp_path / f"{run}.jsonl").load()
    graded = Counter((r.item_key, r.sample) for r in journal if r.graded)
    assert graded == Counter({(line_key(line), s): 1 for line in raw for s in (0, 1)})
