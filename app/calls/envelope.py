"""The wire shapes of a tool call (the Responses `function_call` item in, `function_call_output` out),
defined once in `sparring.wire` for the server and the client."""

from __future__ import annotations

from sparring.wire import ToolCallEnvelope, ToolCallOutput

__all__ = ["ToolCallEnvelope", "ToolCallOutput"]
