"""The wire shapes of a tool call: the Responses `function_call` item in, `function_call_output` out."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from app.rollouts.identity import JSON_DEPTH_MAX, nested_deeper_than


def _text_or_none(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    # Tolerated as their text, but `str()` recurses: a list nested 1,000 levels would crash it.
    if nested_deeper_than(value):
        raise ValueError(f"nests more than {JSON_DEPTH_MAX} levels deep; an id or a name is text")
    return str(value)


class ToolCallEnvelope(BaseModel):
    """Every field optional and unknown fields ignored: curl tests and alpha endpoints send less."""

    model_config = ConfigDict(extra="ignore")

    type: str | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: Any = None
    trace_id: str | None = None
    item: dict[str, Any] = {}

    @field_validator("type", "id", "call_id", "name", "trace_id", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> str | None:
        return _text_or_none(value)

    @field_validator("item", mode="before")
    @classmethod
    def _as_mapping(cls, value: Any) -> dict[str, Any]:
        return value if isinstance(value, dict) else {}


class ToolCallOutput(BaseModel):
    type: str = "function_call_output"
    call_id: str | None
    id: str | None
    output: str
