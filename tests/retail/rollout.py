"""A rollout without the server: tools called as plain functions, writes committed as the server does."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from app.sdk import Base, RolloutState, ToolContext, ToolError
from app.sdk.state import Changes
from tools.retail import pack


class Rollout:
    """One rollout's state, with tools called directly and their writes committed as the server does."""

    def __init__(self, base: Base) -> None:
        self.base = base
        self.changes: Changes = {}
        self.last_writes: Changes = {}

    def _run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[RolloutState, Any]:
        spec = pack.tools[fn.__name__]
        state = RolloutState(self.base, self.changes, writable=spec.mutates)
        if spec.context_param is not None:
            kwargs[spec.context_param] = ToolContext(
                trace_id="trace_test",
                call_id=None,
                tool_name=spec.name,
                item={},
                state=state,
                logger=logging.LoggerAdapter(logging.getLogger("tests.retail"), {}),
            )
        return state, fn(**kwargs)

    def call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Run a tool that must succeed; its output must be what the server can send (a str or JSON)."""
        state, result = self._run(fn, kwargs)
        json.dumps(result)
        self.last_writes = state.writes
        for collection, records in state.writes.items():
            self.changes.setdefault(collection, {}).update(records)
        return result

    def error(self, fn: Callable[..., Any], **kwargs: Any) -> str:
        """Run a tool that must refuse; return the message the model would read after 'Error: '."""
        with pytest.raises(ToolError) as caught:
            self._run(fn, kwargs)
        return caught.value.message

    def get(self, collection: str, key: str) -> Any:
        return RolloutState(self.base, self.changes, writable=False).get(collection, key)

    def view(self) -> RolloutState:
        return RolloutState(self.base, self.changes, writable=False)
