"""The retail data the tests read: the cache under .sparring (fetched once per machine), by task id."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.sdk import Base
from app.sdk.state import Changes
from tools.retail import check, data, dataset, tasks
from tools.retail.data import RetailData
from tools.retail.tasks import Replay, RetailTask, Split, ToolCall
from tools.retail.tools import database

REPO_ROOT = Path(__file__).resolve().parents[2]
# The cache `make run` uses too (SPARRING_HOME defaults to .sparring): the download happens once.
HOME = REPO_ROOT / ".sparring"
DATA_DIR = data.DATA.cache_dir(HOME)
RESOURCES = RetailData(DATA_DIR)  # what the pack's lifespan yields for this data


def fetch() -> Path:
    return data.DATA.fetch(DATA_DIR)


def store() -> Base:
    return database(DATA_DIR)


def load_tasks() -> dict[str, RetailTask]:
    return tasks.load_tasks(DATA_DIR)


def get_task(task_id: str) -> RetailTask:
    return tasks.get_task(DATA_DIR, task_id)


def split_task_ids(split: Split) -> list[str]:
    return tasks.split_task_ids(DATA_DIR, split)


def gold_calls(task: RetailTask | str) -> list[ToolCall]:
    return tasks.gold_calls(get_task(task) if isinstance(task, str) else task)


def replay_calls(task_id: str) -> list[ToolCall]:
    return tasks.replay_calls(get_task(task_id))


def replay(calls: Sequence[ToolCall]) -> Replay:
    return tasks.replay(calls, base=store())


def gold_changes(calls: Sequence[ToolCall]) -> Changes:
    return check.gold_changes(calls, DATA_DIR)


def build_dataset(split: Split) -> list[dict[str, Any]]:
    return dataset.build_dataset(DATA_DIR, split)


def write_dataset(split: Split, out: Path) -> int:
    return dataset.write_dataset(DATA_DIR, split, out)


def read_policy() -> str:
    return data.read_policy(DATA_DIR)
