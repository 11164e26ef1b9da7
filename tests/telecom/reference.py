"""τ²-bench's own telecom environment and evaluators, run from the pinned wheel: the reference the tests hold
the pack to (outputs of both sides, final carrier records and phone, reward). Nothing here is computed by
the pack."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.tau2_reference import use_reference
from tests.telecom.corpus import Call, masked

use_reference()

from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage  # noqa: E402
from tau2.data_model.message import ToolCall as Tau2ToolCall  # noqa: E402
from tau2.data_model.tasks import RewardType, Task  # noqa: E402
from tau2.domains.telecom.environment import get_environment, get_tasks  # noqa: E402
from tau2.domains.telecom.user_data_model import PerformanceLevel, VpnDetails  # noqa: E402
from tau2.domains.telecom.user_tools import TelecomUserTools  # noqa: E402
from tau2.evaluator.evaluator_action import ActionEvaluator  # noqa: E402
from tau2.evaluator.evaluator_env import EnvironmentEvaluator  # noqa: E402

_TASKS: dict[str, Task] = {}


def task(task_id: str) -> Task:
    if not _TASKS:
        _TASKS.update({t.id: t for t in get_tasks(None)})
    return _TASKS[task_id]


@dataclass
class Run:
    outputs: list[str]  # the content of each ToolMessage, as its side reads it
    state: str  # the final carrier database and phone, in the shape corpus.state_text writes


def _kept(model: Any) -> Any:
    return json.loads(json.dumps(model.model_dump(), default=str))


def fresh_process() -> None:
    """Undo what earlier runs left in this process: the reference's `break_vpn` breaks the VPN object its
    user toolkit shares between all phones (a class attribute), so each run starts as a new process."""
    TelecomUserTools.default_vpn_details = VpnDetails(
        server_address="192.168.1.1", protocol="OpenVPN", server_performance=PerformanceLevel.EXCELLENT
    )


def run(task_id: str, calls: Sequence[Call]) -> Run:
    """The task's initialization, then the calls, on a fresh τ²-bench telecom environment."""
    fresh_process()
    env = get_environment()
    env.set_state(
        initialization_data=None,
        initialization_actions=task(task_id).initial_state.initialization_actions,
        message_history=[],
    )
    outputs = []
    for index, (requestor, name, arguments) in enumerate(calls):
        call = Tau2ToolCall(id=f"call_{index}", name=name, arguments=arguments, requestor=requestor)
        outputs.append(str(env.get_response(call).content))
    state = {"db": _kept(env.tools.db), "user_db": _kept(env.user_tools.db)}
    text = masked(json.dumps(state, sort_keys=True))
    return Run(outputs=[masked(output) for output in outputs], state=text)


def reward(task_id: str, calls: Sequence[Call], outputs: Sequence[str]) -> float:
    """τ²-bench's reward for a trajectory of these calls of both sides (each answered by `outputs`): its
    environment and action evaluators, combined on the task's reward basis."""
    trajectory: list[Any] = []
    for index, ((requestor, name, arguments), output) in enumerate(zip(calls, outputs, strict=True)):
        call = Tau2ToolCall(id=f"call_{index}", name=name, arguments=arguments, requestor=requestor)
        if requestor == "user":
            trajectory.append(UserMessage(role="user", content=None, tool_calls=[call]))
        else:
            trajectory.append(AssistantMessage(role="assistant", content=None, tool_calls=[call]))
        error = output.startswith("Error:")
        answer = ToolMessage(id=call.id, role="tool", content=output, requestor=requestor, error=error)
        trajectory.append(answer)
    trajectory.append(AssistantMessage(role="assistant", content="Done."))
    reference = task(task_id)
    fresh_process()
    env = EnvironmentEvaluator.calculate_reward(
        environment_constructor=get_environment, task=reference, full_trajectory=trajectory
    )
    action = ActionEvaluator.calculate_reward(task=reference, full_trajectory=trajectory)
    basis = set(reference.evaluation_criteria.reward_basis)
    total = 1.0
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        total *= env.reward
    if RewardType.ACTION in basis:
        total *= action.reward
    return total
