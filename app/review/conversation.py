"""The rollout page's reading of a rollout: its conversation with the logged calls in place, and files.

The stored conversation (sparring.conversation) names each tool call by `call_id`; the call log has
the same ids. A turn's calls are shown where the model asked for them, each with its logged call
(outcome, latency, flags) and the output the model read; the logged calls the conversation does not
name are listed after it. A call whose arguments hold a `path` and a `content` writes a file: it is
shown as code, with a diff against the file as it was before (the workspace's starting file, or what
the rollout last wrote or read there).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.packs import Registry
from app.rollouts.shapes import RolloutCall, TranscriptOut

DIFF_CONTEXT = 3
DIFF_MAX_LINES = 2000  # a longer diff is cut (the file itself is shown whole)


@dataclass(frozen=True)
class FileChange:
    """A file a call wrote: its new text, and its diff against `before_from` (None: a new file)."""

    path: str
    text: str
    diff: list[tuple[str, str]]  # (kind: add | del | hunk | same, line)
    before_from: str | None  # "starting file" | "earlier write" | "earlier read" | None
    added: int
    removed: int


@dataclass(frozen=True)
class ShownCall:
    """A call the model asked for: its name and arguments, the logged call, what the model read."""

    call_id: str
    name: str
    arguments: str
    logged: RolloutCall | None
    output: str | None  # the conversation's tool message, when there is one


@dataclass
class ShownMessage:
    role: str
    content: str
    reasoning: str | None = None
    calls: list[ShownCall] = field(default_factory=list)


@dataclass(frozen=True)
class ConversationView:
    model: str | None
    source: str | None
    messages: list[ShownMessage]
    unmatched: list[RolloutCall]  # logged calls the conversation never asked for


def conversation_view(
    transcript: TranscriptOut | None, timeline: Sequence[RolloutCall]
) -> ConversationView | None:
    """The conversation with the logged calls in place; None when no conversation was stored."""
    if transcript is None:
        return None
    logged = {call.call_id: call for call in timeline if call.call_id}
    outputs = {m.get("call_id"): m.get("content") for m in transcript.messages if m.get("role") == "tool"}
    asked = {
        c.get("call_id")
        for m in transcript.messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or ()
    }
    shown: list[ShownMessage] = []
    for message in transcript.messages:
        role = str(message.get("role", ""))
        if role == "tool" and message.get("call_id") in asked:
            continue  # shown with the call that asked for it
        entry = ShownMessage(role, str(message.get("content") or ""), message.get("reasoning"))
        for call in message.get("tool_calls") or ():
            call_id = str(call.get("call_id", ""))
            entry.calls.append(
                ShownCall(
                    call_id,
                    str(call.get("name", "")),
                    str(call.get("arguments", "")),
                    logged.get(call_id),
                    outputs.get(call_id),
                )
            )
        shown.append(entry)
    unmatched = [call for call in timeline if call.call_id not in asked]
    return ConversationView(transcript.model, transcript.source, shown, unmatched)


def _file_arguments(call: RolloutCall) -> tuple[str, str | None] | None:
    """(path, content) of a call that writes a file, (path, None) of one that reads one, else None."""
    arguments = call.parsed_arguments()
    if not isinstance(arguments, Mapping) or not isinstance(arguments.get("path"), str):
        return None
    content = arguments.get("content")
    if isinstance(content, str):
        return arguments["path"], content
    if "read" in call.tool and set(arguments) == {"path"}:
        return arguments["path"], None
    return None


def file_changes(timeline: Sequence[RolloutCall], starting: Mapping[str, str]) -> dict[int, FileChange]:
    """Per call (by seq) that wrote a file: the file, and its diff against what the path held before."""
    known: dict[str, tuple[str, str]] = {path: (text, "starting file") for path, text in starting.items()}
    changes: dict[int, FileChange] = {}
    for call in timeline:
        found = _file_arguments(call)
        if found is None or call.outcome not in ("ok", "replayed"):
            continue
        path, content = found
        if content is None:
            if call.output is not None:
                known[path] = (call.output, "earlier read")
            continue
        before, before_from = known.get(path, ("", None))
        diff, added, removed = _diff(before, content)
        changes[call.seq] = FileChange(path, content, diff, before_from, added, removed)
        known[path] = (content, "earlier write")
    return changes


def _diff(before: str, after: str) -> tuple[list[tuple[str, str]], int, int]:
    lines = list(difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=DIFF_CONTEXT))[
        2:
    ]
    diff: list[tuple[str, str]] = []
    added = removed = 0
    for n, line in enumerate(lines):  # the counts are the whole diff's, the lines shown are cut
        kind = {"+": "add", "-": "del", "@": "hunk"}.get(line[:1], "same")
        added += kind == "add"
        removed += kind == "del"
        if n < DIFF_MAX_LINES:
            diff.append((kind, line))
    if len(lines) > DIFF_MAX_LINES:
        diff.append(("hunk", f"… {len(lines) - DIFF_MAX_LINES} more lines of the diff"))
    return diff, added, removed


def starting_files(
    registry: Registry, timeline: Sequence[RolloutCall], item: Mapping[str, Any]
) -> dict[str, str]:
    """The starting files of the packs whose tools the rollout called, for its dataset row."""
    files: dict[str, str] = {}
    for name in {registry.tools[call.tool].pack for call in timeline if call.tool in registry.tools}:
        pack = registry.packs.get(name)
        if pack is not None:
            files.update(pack.files_at_start(item))
    return files
