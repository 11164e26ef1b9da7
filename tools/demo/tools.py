"""The demo tools: one stateless, two that read and write a per-rollout notebook."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.sdk import Pack, ToolContext, ToolError

pack = Pack("demo", description="Echo and a per-rollout notebook, for trying sparring out.")


@pack.tool
def echo(text: Annotated[str, Field(description="Text to send back unchanged.")]) -> str:
    """Return the text unchanged."""
    return text


@pack.tool(mutates=True)
def add_note(
    ctx: ToolContext,
    title: Annotated[str, Field(description="Short title of the note; must be unique in this conversation.")],
    body: Annotated[str, Field(description="Text of the note.")] = "",
) -> dict[str, object]:
    """Save a note in this conversation's notebook and return it with its number."""
    if not title.strip():
        raise ToolError("title must not be empty")
    if (("notes", title)) in ctx.state:
        raise ToolError(f"a note titled {title!r} already exists")
    number = len(ctx.state.keys("notes")) + 1
    note = {"number": number, "title": title, "body": body}
    ctx.state.put("notes", title, note)
    return note


@pack.tool
def list_notes(ctx: ToolContext) -> list[dict[str, object]]:
    """List the notes saved in this conversation, oldest first."""
    return sorted((note for _, note in ctx.state.items("notes")), key=lambda n: int(n["number"]))
