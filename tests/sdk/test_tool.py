"""Tool definitions: strict-mode schemas from signatures, and bad signatures refused at definition."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from app.sdk import Pack, ToolContext, ToolDefinitionError, build_spec
from tests.packs import faults_pack


def walk_objects(schema: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    if schema.get("type") == "object":
        found.append(schema)
    for value in schema.values():
        if isinstance(value, dict):
            found.extend(walk_objects(value))
        elif isinstance(value, list):
            found.extend(walk_objects(v) for v in value if isinstance(v, dict))  # type: ignore[arg-type]
    return [f for item in found for f in (item if isinstance(item, list) else [item])]


def test_strict_schema_for_optional_enum_list_nested_and_literal() -> None:
    params = faults_pack.tools["shapes"].parameters
    assert params["type"] == "object"
    assert params["additionalProperties"] is False
    assert (
        sorted(params["required"])
        == sorted(params["properties"])
        == [
            "address",
            "kind",
            "limit",
            "mode",
            "query",
            "tags",
        ]
    )
    props = params["properties"]
    assert props["query"] == {"description": "What to look for.", "title": "Query", "type": "string"}
    assert props["kind"]["enum"] == ["a", "b"]
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    # Optional values are nullable, still required (strict mode).
    assert {"type": "null"} in props["limit"]["anyOf"] and {"type": "integer"} in props["limit"]["anyOf"]
    assert "default" not in props["limit"]
    assert {"type": "null"} in props["address"]["anyOf"]
    # The enum class and the nested model live in $defs, closed and fully required too.
    defs = params["$defs"]
    assert defs["Mode"]["enum"] == ["fast", "slow"]
    assert defs["Address"]["additionalProperties"] is False
    assert defs["Address"]["required"] == ["city", "zip"]
    assert defs["Address"]["properties"]["zip"]["description"] == "Postal code."
    for obj in walk_objects(params):
        assert obj.get("additionalProperties") is False, obj


def test_context_parameter_is_injected_not_shown() -> None:
    pack = Pack("t")

    @pack.tool
    def f(ctx: ToolContext, x: int) -> int:
        """Doc."""
        return x

    spec = pack.tools["f"]
    assert spec.context_param == "ctx"
    assert list(spec.parameters["properties"]) == ["x"]


def test_decorator_returns_the_function_unchanged() -> None:
    pack = Pack("t")

    def g(x: int) -> int:
        """Double."""
        return 2 * x

    assert pack.tool(g) is g
    assert pack.tool(mutates=True, name="g2")(g) is g
    assert g(4) == 8
    assert pack.tools["g2"].mutates is True and pack.tools["g"].mutates is False


def test_function_tool_entry_for_datasets() -> None:
    entry = faults_pack.tools["refuse"].function_tool()
    assert entry["type"] == "function"
    assert entry["function"]["name"] == "refuse"
    assert entry["function"]["strict"] is True
    assert entry["function"]["description"] == "Raise a ToolError with the reason."


def test_untyped_parameter_is_refused() -> None:
    def f(x) -> int:  # type: ignore[no-untyped-def]
        """Doc."""
        return 1

    with pytest.raises(ToolDefinitionError, match="parameter 'x' has no type annotation"):
        build_spec(f)


@pytest.mark.parametrize("name", ["café", "x²", "工具", "a b", "a" * 65])
def test_a_name_the_platform_refuses_is_refused_at_definition(name: str) -> None:
    """A function name is `^[a-zA-Z0-9_-]{1,64}$` for the OpenAI and Foundry APIs: a pack whose tool
    has another name must not start, only to fail when a job or a dataset names it."""

    def f(x: int) -> int:
        """Doc."""
        return x

    with pytest.raises(ToolDefinitionError, match="must be 1-64 letters, digits"):
        build_spec(f, name=name)


@pytest.mark.parametrize("name", ["get_order", "get-order", "_private", "A1", "a" * 64])
def test_a_name_the_platform_takes_is_taken(name: str) -> None:
    def f(x: int) -> int:
        """Doc."""
        return x

    assert build_spec(f, name=name).name == name


def test_duplicate_names_are_refused() -> None:
    pack = Pack("t")

    @pack.tool
    def f(x: int) -> int:
        """Doc."""
        return x

    with pytest.raises(ToolDefinitionError, match="already has a tool named 'f'"):
        pack.tool(f)


class Opaque:
    """Not a type pydantic can describe."""


def test_unsupported_type_is_refused() -> None:
    def f(x: Opaque) -> int:
        """Doc."""
        return 1

    with pytest.raises(ToolDefinitionError, match="unsupported parameter type"):
        build_spec(f)


def test_varargs_and_missing_docstring_are_refused() -> None:
    def f(*xs: int) -> int:
        """Doc."""
        return 1

    def g(x: int) -> int:
        return x

    with pytest.raises(ToolDefinitionError, match="must be a named parameter"):
        build_spec(f)
    with pytest.raises(ToolDefinitionError, match="needs a docstring"):
        build_spec(g)


class Filters(BaseModel):
    size: int


def test_bind_validates_and_fills_defaults() -> None:
    def f(a: str, filters: Filters, n: int = 3, note: str | None = None) -> str:
        """Doc."""
        return a

    spec = build_spec(f)
    bound = spec.bind({"a": "x", "filters": {"size": 2}, "n": None, "note": None})
    assert bound["n"] == 3 and bound["note"] is None and bound["filters"].size == 2
    assert spec.bind({"a": "x", "filters": {"size": 2}, "n": 7})["n"] == 7


def test_inline_is_for_synchronous_tools_only() -> None:
    pack = Pack("inline_defs")

    async def waits() -> str:
        """Wait."""
        return "x"

    with pytest.raises(ToolDefinitionError, match="inline=True is for synchronous functions"):
        pack.tool(inline=True)(waits)

    def quick() -> str:
        """Quick."""
        return "x"

    assert pack.tool(inline=True)(quick) is quick
    assert pack.tools["quick"].inline is True
    assert build_spec(quick).inline is False
