"""verl against sparring: an agent loop whose tools and reward come from sparring.

Written against verl's experimental agent loop API (`verl.experimental.agent_loop`: `AgentLoopBase`,
`register`, `AgentLoopOutput`, `ToolParser`), as its `ToolAgentLoop` uses it. verl keeps generating
tokens itself (its rollout server, token in and token out, so the log-probs it trains on are its
own); each trajectory is one sparring rollout: the parsed tool calls of a turn go to sparring at once
(parallel calls), their outputs are appended as tool messages (masked out of the loss), and the
trajectory's `reward_score` is sparring's grade. Select it with
`actor_rollout_ref.rollout.agent.agent_loop_config_path` naming `sparring_agent`, and put each dataset
line (from `sparring dataset build`) in the row's `extra_info.line`.
"""

from __future__ import annotations

import os
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.experimental.agent_loop.tool_parser import ToolParser

from sparring.client import AsyncEnvironment

GRADER = "retail"
MAX_TURNS = 30
# Keep equal to actor_rollout_ref.rollout.response_length: the tokens one trajectory may hold.
RESPONSE_LENGTH = int(os.environ.get("SPARRING_RESPONSE_LENGTH", "8192"))


def environment() -> AsyncEnvironment:
    return AsyncEnvironment(
        os.environ["SPARRING_URL"],
        os.environ["SPARRING_KEY"],
        grader_key=os.environ.get("SPARRING_GRADER_KEY"),
        run=os.environ.get("SPARRING_RUN", "verl"),
    )


@register("sparring_agent")
class SparringAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        line = kwargs["extra_info"]["line"]
        messages = [
            {**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in line["messages"]
        ]
        item = {k: v for k, v in line.items() if k != "tools"}
        parser = ToolParser.get_tool_parser("hermes", self.tokenizer)
        template = self.tokenizer.apply_chat_template
        prompt_ids = await self.loop.run_in_executor(
            None, lambda: template(messages, tools=line["tools"], add_generation_prompt=True, tokenize=True)
        )
        empty = template([{}], add_generation_prompt=False, tokenize=True)  # the template's own prefix
        response_ids: list[int] = []
        mask: list[int] = []
        text, turns = "", 0
        async with environment() as env, env.rollout(item=item) as rollout:
            while turns < MAX_TURNS:
                turns += 1
                out = await self.server_manager.generate(
                    request_id=rollout.trace_id,
                    prompt_ids=prompt_ids + response_ids,
                    sampling_params=sampling_params,
                )
                response_ids += out.token_ids
                mask += [1] * len(out.token_ids)
                text, calls = await parser.extract_tool_calls(out.token_ids)
                if not calls or len(response_ids) >= RESPONSE_LENGTH:
                    break
                outputs = await rollout.call_many([(call.name, call.arguments) for call in calls])
                tool_messages = [{"role": "tool", "content": output} for output in outputs]
                tool_ids = template(tool_messages, add_generation_prompt=True, tokenize=True)[len(empty) :]
                response_ids += tool_ids
                mask += [0] * len(tool_ids)
            reward = await rollout.grade(GRADER, text)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:RESPONSE_LENGTH],
            response_mask=mask[:RESPONSE_LENGTH],
            reward_score=reward,
            num_turns=2 * turns + 1,
            metrics=AgentLoopMetrics(),
        )
