"""The telecom data the tests read: the cache under .sparring (fetched once per machine), by task id."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from app.sdk import RolloutState
from app.sdk.state import Changes
from tools.telecom import data, tasks
from tools.telecom.records import CARRIER, DEVICE, PHONE, SURROUNDINGS
from tools.telecom.rollout import database
from tools.telecom.tasks import Split, TelecomTask

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME = REPO_ROOT / ".sparring"
DATA_DIR = data.DATA.cache_dir(HOME)

Call = tuple[str, str, dict[str, Any]]  # (requestor, tool name, arguments)

# A draft bill made by a refuel gets a random id in the reference as in the pack: compared as one name.
_NEW_BILL = re.compile(r"B[0-9a-f]{8}\b")


def fetch() -> Path:
    return data.DATA.fetch(DATA_DIR)


def get_task(task_id: str) -> TelecomTask:
    return tasks.get_task(DATA_DIR, task_id)


def split_task_ids(split: Split) -> list[str]:
    return tasks.split_task_ids(DATA_DIR, split)


def gold_calls(task_id: str) -> list[Call]:
    """The task's gold actions of both sides, in order."""
    return [
        (action.requestor, action.name, dict(action.arguments))
        for action in get_task(task_id).evaluation_criteria.actions
    ]


def masked(text: str) -> str:
    return _NEW_BILL.sub("B<new>", text)


def state_text(changes: Changes) -> str:
    """The carrier's records (as τ²-bench's lists, in order) and the phone after `changes`, as JSON."""
    state = RolloutState(database(DATA_DIR), changes, writable=False)
    carrier = {name: [record for _, record in state.items(name)] for name in CARRIER}
    phone = {key: state.get(PHONE, key) for key in (DEVICE, SURROUNDINGS)}
    return masked(json.dumps({"db": carrier, "user_db": phone}, sort_keys=True))
