"""A scripted model's turns that play a retail task's gold calls, then state what it must communicate."""

from __future__ import annotations

from tests.remote.model_server import Turn
from tests.retail.corpus import get_task, replay_calls
from tools.retail import pack
from tools.retail.tasks import ToolCall


def gold_turns(task_id: str) -> list[Turn]:
    """The gold calls, a run of reads in one turn (parallel calls), each write alone; then the answer."""
    calls: list[ToolCall] = replay_calls(task_id)
    turns: list[Turn] = []
    for name, arguments in calls:
        reads = (
            turns
            and not pack.tools[name].mutates
            and not any(pack.tools[n].mutates for n, _ in turns[-1].calls)
        )
        if reads:
            turns[-1].calls.append((name, arguments))
        else:
            turns.append(Turn(calls=[(name, arguments)]))
    answer = "Done. " + " and ".join(get_task(task_id).evaluation_criteria.communicate_info)
    return [*turns, Turn(text=answer)]
