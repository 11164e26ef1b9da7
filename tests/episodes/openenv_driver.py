"""Drives sparring's OpenEnv mount with openenv's own, unmodified clients; run by the client's venv.

openenv 0.10.0 needs fastmcp 3, which needs mcp < 2, and sparring's server pins mcp 2.3.0: the two
cannot share a virtualenv, so the tests run this script with the client venv's Python
(tests/episodes/openenv_client.py builds it). It reads one JSON command on stdin and prints one JSON
answer on stdout. It imports nothing of sparring's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from openenv import GenericEnvClient
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.mcp_client import MCPToolClient


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools]


async def list_tools(url: str, headers: dict[str, str], args: dict[str, Any]) -> Any:
    """The tools as `MCPToolClient.list_tools()` (over /mcp) and a `list_tools` step (over /ws) give them."""
    async with MCPToolClient(base_url=url, headers=headers) as env:
        over_mcp = _tools(await env.list_tools())
    async with GenericEnvClient(base_url=url, headers=headers) as generic:
        step = await generic.step({"type": "list_tools"})
    return {"mcp": over_mcp, "ws": step.observation["tools"], "ws_done": step.done, "ws_meta": step.metadata}


async def _after_submit(call: Any) -> str:
    try:
        await call()
    except Exception as exc:  # the refusal, as the client raises it
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


async def mcp_episode(url: str, headers: dict[str, str], args: dict[str, Any]) -> Any:
    """reset over /ws, each call with `MCPToolClient.call_tool` (over /mcp), then submit over /ws."""
    async with MCPToolClient(base_url=url, headers=headers) as env:
        reset = await env.reset(**args["reset"])
        outputs = [await env.call_tool(call["name"], **call["arguments"]) for call in args["calls"]]
        state = await env.state()
        submitted = await env.step(CallToolAction(tool_name="submit", arguments={"answer": args["answer"]}))
        after = await _after_submit(
            lambda: env.call_tool(args["calls"][0]["name"], **args["calls"][0]["arguments"])
        )
        final = await env.state()
    return {
        "reset": reset.observation.model_dump(),
        "outputs": outputs,
        "episode_id": state.episode_id,
        "step_count": state.step_count,
        "reward": submitted.reward,
        "done": submitted.done,
        "submit_result": submitted.observation.result,
        "after_submit": after,
        "final_episode_id": final.episode_id,
    }


async def ws_episode(url: str, headers: dict[str, str], args: dict[str, Any]) -> Any:
    """reset, each call as `step(CallToolAction)`, state, submit and one call after it, all over /ws."""
    async with GenericEnvClient(base_url=url, headers=headers) as env:
        reset = await env.reset(**args["reset"])
        steps = []
        for call in args["calls"]:
            result = await env.step(CallToolAction(tool_name=call["name"], arguments=call["arguments"]))
            steps.append(
                {"observation": result.observation, "done": result.done, "metadata": result.metadata}
            )
        state = await env.state()
        submitted = await env.step(CallToolAction(tool_name="submit", arguments={"answer": args["answer"]}))
        after = await _after_submit(
            lambda: env.step(
                CallToolAction(tool_name=args["calls"][0]["name"], arguments=args["calls"][0]["arguments"])
            )
        )
    return {
        "reset": reset.observation,
        "steps": steps,
        "state": state,
        "reward": submitted.reward,
        "done": submitted.done,
        "submit_observation": submitted.observation,
        "after_submit": after,
    }


async def refused(url: str, headers: dict[str, str], args: dict[str, Any]) -> Any:
    """What the clients get with these headers (a missing or wrong key)."""
    answers: dict[str, str] = {}
    try:
        async with GenericEnvClient(base_url=url, headers=headers) as env:
            await env.reset(split="test", index=0)
        answers["ws"] = "accepted"
    except Exception as exc:
        answers["ws"] = f"{type(exc).__name__}: {exc}"
    env = MCPToolClient(base_url=url, headers=headers)
    try:
        await env.call_tool("get_order_details", order_id="#W0000000")
        answers["mcp"] = "accepted"
    except Exception as exc:
        answers["mcp"] = f"{type(exc).__name__}: {exc}"
    finally:
        await env.close()
    return answers


SCENARIOS = {
    "list_tools": list_tools,
    "mcp_episode": mcp_episode,
    "ws_episode": ws_episode,
    "refused": refused,
}


def main() -> None:
    command = json.loads(sys.stdin.read())
    scenario = SCENARIOS[command["scenario"]]
    answer = asyncio.run(scenario(command["url"], command["headers"], command.get("args", {})))
    sys.stdout.write(json.dumps(answer, default=str))


if __name__ == "__main__":
    main()
