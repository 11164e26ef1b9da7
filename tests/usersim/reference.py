"""τ²-bench's own user simulator, from the pinned wheel, building the requests its user model receives.

τ²'s `UserSimulator` calls its model through litellm, which the tests do not install: a stand-in
`litellm` module lets `tau2.utils.llm_utils` import, and `generate` (the only model call) is replaced
by a script that records the messages τ² would send and answers the scripted user's turns.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from tests.tau2_reference import use_reference

LITELLM_MODULES = ("litellm", "litellm.caching", "litellm.caching.caching", "litellm.main")


def _stand_in_litellm() -> None:
    """Modules named like litellm's, holding the names `tau2.utils.llm_utils` imports (never called)."""
    for name in LITELLM_MODULES:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        for attribute in ("completion", "completion_cost", "Cache", "ModelResponse", "Usage"):
            setattr(module, attribute, None)
        module.disable_cache = lambda: None  # type: ignore[attr-defined]  # run at import time
        sys.modules[name] = module


@contextmanager
def tau2_user(scenario: Mapping[str, Any], *, user_tools: bool = False) -> Iterator[Any]:
    """τ²'s `UserSimulator` for `scenario` (a `user_scenario` object), built as τ²'s `run` builds it."""
    use_reference()
    _stand_in_litellm()
    from tau2.data_model.tasks import UserScenario
    from tau2.user import user_simulator

    user = user_simulator.UserSimulator(
        tools=[] if user_tools else None,
        instructions=str(UserScenario.model_validate(dict(scenario))),
        llm="scripted",
        llm_args={"temperature": 0.0},
    )
    yield user


def requests_of(
    scenario: Mapping[str, Any], agent_texts: Sequence[str], user_texts: Sequence[str]
) -> list[list[dict[str, Any]]]:
    """The chat messages τ²'s user model receives at each turn of a conversation in which the agent
    writes `agent_texts` (its greeting first) and the user answers `user_texts`."""
    sent: list[list[dict[str, Any]]] = []
    with tau2_user(scenario) as user:
        from tau2.data_model.message import AssistantMessage
        from tau2.user import user_simulator
        from tau2.utils.llm_utils import to_litellm_messages

        answers = iter(user_texts)

        def generate(*, model: str, messages: list[Any], tools: Any = None, **params: Any) -> Any:
            sent.append(to_litellm_messages(messages))
            return AssistantMessage(role="assistant", content=next(answers))

        original = user_simulator.generate
        user_simulator.generate = generate
        try:
            state = user.get_init_state()
            for text in agent_texts:
                user.generate_next_message(AssistantMessage(role="assistant", content=text), state)
        finally:
            user_simulator.generate = original
    return sent


def telecom_user(task_id: str) -> tuple[str, list[dict[str, Any]]]:
    """The system prompt and the tools τ²'s `run` gives the user model of a telecom task: its
    `UserSimulator` with the environment's user tools (the phone's), and their chat-completions schemas."""
    use_reference()
    _stand_in_litellm()
    from tau2.domains.telecom.environment import get_environment, get_tasks
    from tau2.user import user_simulator

    (task,) = [task for task in get_tasks(None) if task.id == task_id]
    tools = get_environment().get_user_tools()
    user = user_simulator.UserSimulator(
        tools=tools, instructions=str(task.user_scenario), llm="scripted", llm_args={"temperature": 0.0}
    )
    return user.system_prompt, [tool.openai_schema for tool in tools]
