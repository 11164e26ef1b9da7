"""τ²-bench's own airline environment and evaluators, run from the pinned wheel: the reference the tests hold
the pack to (outputs, final database, reward). Nothing here is computed by the pack."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.tau2_reference import use_reference
from tools.airline.tasks import ToolCall

use_reference()

from tau2.data_model.message import AssistantMessage, ToolMessage  # noqa: E402
from tau2.data_model.message import ToolCall as Tau2ToolCall  # noqa: E402
from tau2.data_model.tasks import RewardType, Task  # noqa: E402
from tau2.domains.airline.data_model import FlightDB  # noqa: E402
from tau2.domains.airline.environment import get_environment, get_tasks  # noqa: E402
from tau2.domains.airline.utils import AIRLINE_DB_PATH  # noqa: E402
from tau2.evaluator.evaluator_communicate import CommunicateEvaluator  # noqa: E402
from tau2.evaluator.evaluator_env import EnvironmentEvaluator  # noqa: E402

_RAW_DB: list[Any] = []


def environment(solo_mode: bool = False) -> Any:
    """A fresh τ²-bench airline environment on the database it ships (the file is parsed once)."""
    if not _RAW_DB:
        _RAW_DB.append(json.loads(AIRLINE_DB_PATH.read_text()))
    return get_environment(db=FlightDB.model_validate(_RAW_DB[0]), solo_mode=solo_mode)


@dataclass
class Run:
    outputs: list[str]  # the content of each ToolMessage, as the agent reads it
    database: str  # the final database as τ²-bench hashes it: json.dumps(model_dump, sort_keys=True)


def run(calls: Sequence[ToolCall]) -> Run:
    """The calls on a fresh τ²-bench airline environment, through `Environment.get_response`."""
    env = environment()
    outputs = []
    for index, (name, arguments) in enumerate(calls):
        message = env.get_response(Tau2ToolCall(id=f"call_{index}", name=name, arguments=arguments))
        outputs.append(str(message.content))
    database = json.dumps(env.tools.db.model_dump(), sort_keys=True, default=str)
    return Run(outputs=outputs, database=database)


_TASKS: dict[str, Task] = {}


def task(task_id: str) -> Task:
    if not _TASKS:
        _TASKS.update({t.id: t for t in get_tasks(None)})
    return _TASKS[task_id]


def reward(task_id: str, calls: Sequence[ToolCall], outputs: Sequence[str], answer: str) -> float:
    """τ²-bench's reward for a trajectory of these calls (one per assistant turn, answered by `outputs`)
    and a final assistant message `answer`: its environment and communicate evaluators, combined on the
    task's reward basis as `evaluate_simulation` (evaluation type ALL) combines them."""
    trajectory: list[Any] = []
    for index, ((name, arguments), output) in enumerate(zip(calls, outputs, strict=True)):
        call = Tau2ToolCall(id=f"call_{index}", name=name, arguments=arguments)
        trajectory.append(AssistantMessage(role="assistant", content=None, tool_calls=[call]))
        trajectory.append(
            ToolMessage(id=call.id, role="tool", content=output, error=output.startswith("Error:"))
        )
    trajectory.append(AssistantMessage(role="assistant", content=answer))
    reference = task(task_id)
    env = EnvironmentEvaluator.calculate_reward(
        environment_constructor=environment, task=reference, full_trajectory=trajectory
    )
    communicate = CommunicateEvaluator.calculate_reward(task=reference, full_trajectory=trajectory)
    basis = set(reference.evaluation_criteria.reward_basis)
    total = 1.0
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        total *= env.reward
    if basis & {RewardType.COMMUNICATE}:
        total *= communicate.reward
    return total
