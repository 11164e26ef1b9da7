"""eval-protocol (Fireworks RFT) against sparring: the evaluator of a remote rollout.

sparring runs each rollout itself (`POST /remote/init`, see the README's "Remote rollouts"): it
calls the policy at the URL eval-protocol gives it, so the tracing proxy records every completion,
and the tools through its own tool service under a trace id derived from the rollout id. On the
trainer's side the evaluator scores the rollout by calling sparring's grader with that trace id, so
the grade reads what sparring recorded (the calls, the final state), not a replay.

A rollout that failed is retried by eval-protocol under the same rollout id, and sparring runs the
retry as a new attempt with a trace of its own: the trace id to grade is the one the end carried
(`execution_metadata.extra["trace_id"]`, which the processor copies from the gateway's log).

The processor waits `timeout_seconds` (120 s by default) for each rollout; sparring stops a rollout
after SPARRING_REMOTE_DEADLINE_SECONDS (120 s by default). For longer rollouts raise both, the
processor's a little above sparring's, as below.

Written against eval-protocol 0.3.33 (`evaluation_test`, `RemoteRolloutProcessor`, `EvaluationRow`,
`EvaluateResult`).
"""

from __future__ import annotations

import os
from typing import Any

from eval_protocol.models import EvaluateResult, EvaluationRow, InputMetadata, Message
from eval_protocol.pytest import RemoteRolloutProcessor, evaluation_test

from sparring.client import Environment, GradeFailed, remote_trace_id

SPARRING = Environment(os.environ["SPARRING_URL"], os.environ["SPARRING_GRADER_KEY"])


def sparring_lines(lines: list[dict[str, Any]]) -> list[EvaluationRow]:
    """Lines of `sparring dataset build` as rows: messages and tools, the rest as the row's dataset info."""
    return [
        EvaluationRow(
            messages=[Message(role=m["role"], content=m["content"]) for m in line["messages"]],
            tools=line["tools"],
            input_metadata=InputMetadata(
                row_id=str(line.get("task_id")),
                dataset_info={k: v for k, v in line.items() if k != "tools"},
            ),
        )
        for line in lines
    ]


@evaluation_test(
    input_dataset=["retail-train.jsonl"],
    dataset_adapter=sparring_lines,
    completion_params=[{"model": "accounts/fireworks/models/qwen3-8b", "temperature": 0.7}],
    # With SPARRING_REMOTE_DEADLINE_SECONDS=570 on the server: sparring ends a rollout first, so the
    # processor reads (and retries) sparring's deadline failure instead of timing out itself.
    rollout_processor=RemoteRolloutProcessor(
        remote_base_url=os.environ["SPARRING_REMOTE_URL"], timeout_seconds=600
    ),
    mode="pointwise",
)
def test_retail(row: EvaluationRow) -> EvaluationRow:
    # The trace of the attempt that finished (a retry has its own); the first attempt's otherwise.
    extra = row.execution_metadata.extra or {}
    trace_id = extra.get("trace_id") or remote_trace_id(row.execution_metadata.rollout_id or "")
    answer = row.last_assistant_message()
    text = answer.content if answer is not None and isinstance(answer.content, str) else ""
    try:
        score = SPARRING.grade("retail", text, row.input_metadata.dataset_info or {}, trace_id=trace_id)
    except GradeFailed as exc:
        row.evaluation_result = EvaluateResult(score=0.0, is_score_valid=False, reason=str(exc))
        return row
    row.evaluation_result = EvaluateResult(score=score, reason=f"sparring retail grade of {trace_id}")
    return row
