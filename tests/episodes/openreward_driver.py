"""Drives sparring's ORS front door with openreward's own, unmodified client; run by the client's venv.

openreward 0.1.167 pins sse-starlette==2.3.6 and sparring's server pins mcp 2.3.0 (sse-starlette>=3):
the two cannot share a virtualenv, so the tests run this script with the client venv's Python
(tests/episodes/openreward_client.py builds it). It reads one JSON command on stdin and prints one JSON
answer on stdout; `url` is the origin, the key comes in `headers["api_key"]`. It imports nothing of
sparring's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from openreward import AsyncOpenReward
from openreward.api.errors import ToolCallError


def _env(url: str, headers: dict[str, str]) -> tuple[AsyncOpenReward, Any]:
    os.environ["OPENREWARD_SESSION_URL"] = url
    client = AsyncOpenReward(api_key=headers["api_key"])
    return client, client.environments.get("retail", variant="retail")


def _output(out: Any) -> dict[str, Any]:
    texts = [block.text for block in out.blocks]
    return {"texts": texts, "metadata": out.metadata, "reward": out.reward, "finished": out.finished}


async def tasks(url: str, headers: dict[str, str], args: dict[str, Any]) -> Any:
    """The Task API as `AsyncEnvironment` gives it, and the tools it lists."""
    client, env = _env(url, headers)
    try:
        listed = await env.list_tasks("test")
        third = await env.get_task("test", 3)
        ranged = await env.get_task_range("test", 2, 5)
        tools = await env.list_tools()
        terminal = await env.terminal_tool()
        return {
            "splits": await env.list_splits(),
            "tasks": [t.task_spec for t in listed],
            "env_names": sorted({t.environment_name for t in listed}),
            "num_tasks": await env.num_tasks("test"),
            "third": third.task_spec,
            "range": [t.task_spec for t in ranged],
            "tools": [
                {"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools
            ],
            "terminal": None if terminal is None else {"name": terminal.name, "arg": terminal.arg},
        }
    finally:
        await client.environments.aclose()


async def episode(url: str, headers: dict[str, str], args: dict[str, Any]) -> Any:
    """One session: the prompt, each call, the terminal tool with the answer, then one call after it."""
    client, env = _env(url, headers)
    try:
        async with env.session(split="test", index=args["index"]) as session:
            prompt = [block.text for block in await session.get_prompt()]
            outputs = [_output(await session.call_tool(c["name"], c["arguments"])) for c in args["calls"]]
            submitted = _output(await session.call_terminal_tool(args["answer"]))
            try:
                await session.call_tool(args["calls"][0]["name"], args["calls"][0]["arguments"])
                after: Any = "accepted"
            except ToolCallError as exc:
                after = {"reason": exc.reason, "detail": str(exc)}
    finally:
        await client.environments.aclose()
    return {"prompt": prompt, "outputs": outputs, "submitted": submitted, "after_submit": after}


SCENARIOS = {"tasks": tasks, "episode": episode}


def main() -> None:
    command = json.loads(sys.stdin.read())
    scenario = SCENARIOS[command["scenario"]]
    answer = asyncio.run(scenario(command["url"], command["headers"], command.get("args", {})))
    sys.stdout.write(json.dumps(answer, default=str))


if __name__ == "__main__":
    main()
