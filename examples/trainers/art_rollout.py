"""OpenPipe ART against sparring: the rollout function, with sparring as the environment.

Written against ART's documented rollout contract (`art.Trajectory(messages_and_choices=..., reward=...)`,
`model.openai_client()`, `model.get_inference_name()`): the model's choices go into the trajectory
as ART trains on them, the tool calls go to sparring (one rollout, one trace id, parallel calls of a
turn at once), and the reward is sparring's grade of the final answer.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import art

from sparring.client import AsyncEnvironment

ENV = AsyncEnvironment(
    os.environ["SPARRING_URL"],
    os.environ["SPARRING_KEY"],
    grader_key=os.environ.get("SPARRING_GRADER_KEY"),
    run="art",
)
GRADER = "retail"
MAX_TURNS = 30


async def rollout(model: art.Model, line: dict[str, Any]) -> art.Trajectory:
    client = model.openai_client()
    messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in line["messages"]]
    trajectory = art.Trajectory(messages_and_choices=messages, tools=line["tools"], reward=0.0)
    async with ENV.rollout(item={k: v for k, v in line.items() if k != "tools"}) as episode:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=model.get_inference_name(), messages=trajectory.messages(), tools=line["tools"]
            )
            choice = response.choices[0]
            trajectory.messages_and_choices.append(choice)
            calls = choice.message.tool_calls or []
            if not calls:
                break
            outputs = await episode.call_many([(c.function.name, c.function.arguments) for c in calls])
            for call, output in zip(calls, outputs, strict=True):
                trajectory.messages_and_choices.append(
                    {"role": "tool", "tool_call_id": call.id, "content": output}
                )
        trajectory.reward = await episode.grade(GRADER, choice.message.content or "")
    trajectory.metadata["trace_id"] = episode.trace_id
    return trajectory


async def main(dataset: list[dict[str, Any]]) -> None:
    from art.local import LocalBackend

    model = art.TrainableModel(name="retail-agent", project="sparring", base_model="Qwen/Qwen2.5-7B-Instruct")
    await model.register(LocalBackend())
    for step in range(await model.get_step(), 20):
        batch = dataset[(step * 8) % len(dataset) :][:8]
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(model, line) for _ in range(4)) for line in batch
        )
        await model.train(groups)


if __name__ == "__main__":
    with open("train.jsonl") as lines:  # sparring dataset build retail --split train --out train.jsonl
        asyncio.run(main([json.loads(line) for line in lines]))
