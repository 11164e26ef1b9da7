"""The airline data the tests read: the cache under .sparring (fetched once per machine), by task id."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.sdk import Base, RolloutState
from app.sdk.state import Changes
from tools.airline import data, tasks
from tools.airline.data import AirlineData
from tools.airline.records import COLLECTIONS, reference_database
from tools.airline.tasks import AirlineTask, Split, ToolCall
from tools.airline.tools import database
from tools.retail.tasks import Replay

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME = REPO_ROOT / ".sparring"  # the cache `make run` uses too: the download happens once
DATA_DIR = data.DATA.cache_dir(HOME)
RESOURCES = AirlineData(DATA_DIR)  # what the pack's lifespan yields for this data


def fetch() -> Path:
    return data.DATA.fetch(DATA_DIR)


def store() -> Base:
    return database(DATA_DIR)


def load_tasks() -> dict[str, AirlineTask]:
    return tasks.load_tasks(DATA_DIR)


def get_task(task_id: str) -> AirlineTask:
    return tasks.get_task(DATA_DIR, task_id)


def split_task_ids(split: Split) -> list[str]:
    return tasks.split_task_ids(DATA_DIR, split)


def gold_calls(task_id: str) -> list[ToolCall]:
    return tasks.gold_calls(get_task(task_id))


def replay(calls: Sequence[ToolCall]) -> Replay:
    return tasks.replay(calls, base=store())


def outputs(result: Replay) -> list[str]:
    """What the model read after each call of a replay (a tool's text, or `Error: ...`)."""
    return [f"Error: {call.error}" if call.error is not None else str(call.result) for call in result.results]


def database_text(changes: Changes) -> str:
    """The whole database after `changes`, in τ²-bench's shape, as τ²-bench hashes it (keys sorted)."""
    state = RolloutState(store(), changes, writable=False)
    collections = {name: dict(state.items(name)) for name in COLLECTIONS}
    return json.dumps(reference_database(collections), sort_keys=True, default=str)


def answer_for(task_id: str) -> str:
    """A final answer that states every fact the task's agent must communicate."""
    return "Done. " + " and ".join(get_task(task_id).evaluation_criteria.communicate_info)


def raw_db() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DATA_DIR / "db.json").read_text())
    return loaded
