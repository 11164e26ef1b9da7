"""Runs one rollout through eval-protocol's own RemoteRolloutProcessor and retry loop, unmodified.

Run by tests/remote/test_eval_protocol.py with the interpreter of .venv-eval-protocol (eval-protocol
0.3.33 cannot share sparring's virtualenv): `python driver.py '<json arguments>'`. It prints one line,
`driver-result: <json>`: how eval-protocol ended each row (its status, the extras the gateway gave
it, its messages).

First it checks the tracing-gateway stand-in against eval-protocol's own logging handler: a log that
`FireworksTracingHttpHandler` posts must come back through `FireworksTracingAdapter` (the processor's
reader) as the handler wrote it. Then `rollout_processor_with_retry` (what `@evaluation_test` runs)
drives the processor: a failure it reads from the gateway (code 14, 4, ...) raises, and the row is
retried with a new `/init` under the same rollout id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import uuid
from typing import Any

import aiohttp
from eval_protocol.adapters.fireworks_tracing import FireworksTracingAdapter
from eval_protocol.dataset_logger.dataset_logger import DatasetLogger
from eval_protocol.log_utils.fireworks_tracing_http_handler import FireworksTracingHttpHandler
from eval_protocol.models import EvaluationRow, ExecutionMetadata, InputMetadata, Message, Status
from eval_protocol.pytest.evaluation_test_utils import rollout_processor_with_retry
from eval_protocol.pytest.exception_config import BackoffConfig, ExceptionHandlerConfig
from eval_protocol.pytest.remote_rollout_processor import RemoteRolloutProcessor
from eval_protocol.pytest.types import RolloutProcessorConfig

RESULT = "driver-result: "


class NoLog(DatasetLogger):
    """The rows stay in this process (the default logger writes a local database)."""

    def log(self, row: EvaluationRow) -> None:
        pass

    def read(self, row_id: str | None = None) -> list[EvaluationRow]:
        return []


async def check_gateway(gateway: str) -> dict[str, Any]:
    """A status log posted by eval-protocol's handler, read back by eval-protocol's adapter."""
    rollout_id = f"handler-check-{uuid.uuid4().hex[:8]}"
    logger = logging.getLogger("gateway-check")
    handler = FireworksTracingHttpHandler(gateway_base_url=gateway)
    logger.addHandler(handler)
    status = Status.rollout_error("handler check")
    await asyncio.to_thread(
        logger.error, "checking", extra={"rollout_id": rollout_id, "status": status, "extras": {"k": 1}}
    )
    logger.removeHandler(handler)
    adapter = FireworksTracingAdapter(base_url=gateway)
    async with aiohttp.ClientSession() as session:
        read = await adapter.async_get_status(session, rollout_id=rollout_id)
        logs = await adapter.async_search_logs(session, tags=[f"rollout_id:{rollout_id}"])
    return {"status": (read or {}).get("status"), "logs": logs}


def evaluation_row(args: dict[str, Any]) -> EvaluationRow:
    return EvaluationRow(
        messages=[Message(role=m["role"], content=m["content"]) for m in args["messages"]],
        input_metadata=InputMetadata(row_id="row-1"),
        execution_metadata=ExecutionMetadata(
            invocation_id="inv-1", experiment_id="exp-1", rollout_id=args["rollout_id"], run_id="run-1"
        ),
    )


async def run(args: dict[str, Any]) -> dict[str, Any]:
    """The gateway check, then the rollout `runs` times over (each a fresh row with the same ids)."""
    checked = await check_gateway(args["gateway"])
    return {"gateway_check": checked, "rows": [await run_once(args) for _ in range(args["runs"])]}


async def run_once(args: dict[str, Any]) -> dict[str, Any]:
    processor = RemoteRolloutProcessor(
        remote_base_url=args["remote"],
        model_base_url=args["gateway"],
        poll_interval=0.1,
        timeout_seconds=args["timeout_seconds"],
    )
    config = RolloutProcessorConfig(
        completion_params={"model": args["model"], "temperature": 0.0},
        mcp_config_path="",
        semaphore=asyncio.Semaphore(1),
        logger=NoLog(),
        exception_handler_config=ExceptionHandlerConfig(
            backoff_config=BackoffConfig(strategy="constant", base_delay=0.2, max_tries=args["max_tries"])
        ),
    )
    rows = [row async for row in rollout_processor_with_retry(processor, [evaluation_row(args)], config)]
    await processor.acleanup()
    [row] = rows
    return {
        "status": {"code": int(row.rollout_status.code), "message": row.rollout_status.message},
        "extra": row.execution_metadata.extra or {},
        "messages": [m.model_dump(exclude_none=True) for m in row.messages],
    }


if __name__ == "__main__":
    # Marked: eval-protocol prints its progress bars on the same stream.
    print(RESULT + json.dumps(asyncio.run(run(json.loads(sys.argv[1])))))
