"""Dataset lines for the retail splits: what the model reads, what the grader reads, and the line checks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.retail.corpus import (
    DATA_DIR,
    build_dataset,
    get_task,
    gold_calls,
    read_policy,
    split_task_ids,
    write_dataset,
)
from tools.retail import pack
from tools.retail.data import read_json
from tools.retail.dataset import PREFACE, check_dataset, user_message

SERVED = set(pack.tools)


def test_splits_have_the_benchmarks_tasks_and_pass_the_checks(tmp_path: Path) -> None:
    for split, size in (("train", 74), ("test", 40)):
        out = tmp_path / f"{split}.jsonl"
        assert write_dataset(split, out) == size  # type: ignore[arg-type]
        lines = out.read_text().splitlines()
        assert len(lines) == size
        assert check_dataset(lines, SERVED) == []
        assert [json.loads(line)["task_id"] for line in lines] == split_task_ids(split)  # type: ignore[arg-type]
    assert not set(split_task_ids("train")) & set(split_task_ids("test"))


def test_a_line_carries_the_policy_the_scenario_the_tools_and_the_gold() -> None:
    line = next(line for line in build_dataset("train") if line["task_id"] == "0")
    developer, user = line["messages"]
    assert developer["role"] == "developer"
    assert developer["content"] == PREFACE + read_policy()
    assert "counts as that confirmation" in developer["content"]
    assert user["role"] == "user"
    instructions = get_task("0").user_scenario.instructions
    for text in (instructions.known_info, instructions.unknown_info, instructions.reason_for_call):
        assert text is not None and text in user["content"]
    assert line["tools"] == [spec.function_tool() for spec in pack.tools.values()]
    assert [(a["name"], a["arguments"]) for a in line["actions"]] == gold_calls("0")
    assert line["actions"][0]["action_id"] == "0_0"
    assert line["communicate_info"] == []
    assert set(line) == {"messages", "tools", "task_id", "actions", "communicate_info", "user_simulator"}
    simulator = line["user_simulator"]
    raw = next(t for t in read_json(DATA_DIR, "tasks.json") if t["id"] == "0")["user_scenario"]
    assert simulator["scenario"]["instructions"] == raw["instructions"]
    assert simulator["scenario"]["persona"] == raw.get("persona")
    assert simulator["guidelines"].startswith("# User Simulation Guidelines")
    assert "tools" not in simulator  # a retail customer has no tools of their own
    (opening,) = simulator["agent_messages"]
    assert opening["role"] == "developer" and opening["content"].endswith(read_policy())
    assert "counts as that confirmation" not in opening["content"]  # the user now answers for itself


def test_placeholder_instructions_are_left_out() -> None:
    task = get_task("5")
    assert task.user_scenario.instructions.task_instructions == "."
    message = user_message(task)
    assert "Other notes" not in message
    assert "You are mei_kovacs_8020 in zipcode 28236." in message


def test_the_checks_name_each_broken_line() -> None:
    good = json.dumps(
        {
            "messages": [{"role": "developer", "content": "p"}, {"role": "user", "content": "u"}],
            "tools": [{"type": "function", "function": {"name": "get_order_details"}}],
        }
    )
    ends_with_assistant = json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "hi"}]})
    unknown_tool = json.dumps(
        {"messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "refund_all"}}]}
    )
    problems = check_dataset([good, "{not json", ends_with_assistant, "", unknown_tool, "[1]"], SERVED)
    assert len(problems) == 4
    assert problems[0].startswith("line 2: not valid JSON")
    assert problems[1] == "line 3: the last message must be from the user, not 'assistant'"
    assert problems[2] == "line 5: tools[0] names 'refund_all', which the server does not serve"
    assert problems[3] == "line 6: not a JSON object"
    assert check_dataset([], SERVED) == ["the dataset has no lines"]
    assert check_dataset([good], {"echo"}) == [
        "line 1: tools[0] names 'get_order_details', which the server does not serve"
    ]
