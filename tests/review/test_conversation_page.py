"""The rollout page shows the stored conversation with the logged calls in place (matched by call_id),
and files a call wrote as code with a diff against the workspace's starting file."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from app.review.conversation import DIFF_MAX_LINES, file_changes
from app.rollouts.shapes import RolloutCall
from app.sdk import Pack, ToolContext, ToolError
from tests.conftest import GRADER_KEY, new_trace
from tests.review.conftest import PACKS, ReviewApp
from tests.review.test_ui_auth import login

GRADER = {"Authorization": f"Bearer {GRADER_KEY}"}
START = "def add(a, b):\n    return 0\n"

files_pack = Pack("files", base=lambda resources: {})


@files_pack.starting_files
def files_at_start(resources: object, item: Mapping[str, Any]) -> dict[str, str]:
    return {"solution.py": START} if item.get("task") == "add" else {}


@files_pack.tool(mutates=True)
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Write a file."""
    ctx.state.put("files", path, content)
    return f"wrote {len(content)} bytes to {path}"


@files_pack.tool
def read_file(ctx: ToolContext, path: str) -> str:
    """Read a file."""
    content = ctx.state.get("files", path)
    if content is None:
        raise ToolError(f"no file {path!r}")
    return str(content)


def _page(text: str) -> str:
    return html.unescape(text)


async def test_the_conversation_interleaves_the_logged_calls_and_files_show_as_diffs(
    review_factory: Any,
) -> None:
    async with review_factory(packs=[*PACKS, files_pack]) as review:
        review: ReviewApp
        trace = new_trace()
        item = {"id": "add-1", "task": "add"}
        solution = "def add(a, b):\n    return a + b\n"
        await review.call(
            "write_file",
            {"path": "solution.py", "content": solution},
            trace,
            call_id="w1",
            item=item,
            run="files",
        )
        await review.call("echo", {"text": "<b>unlogged?</b>"}, trace, call_id="e9", run="files")
        await review.grade(trace, answer="Implemented add.", score=1.0, item=item, run="files")
        conversation = {
            "model": "policy-7b",
            "messages": [
                {"role": "user", "content": "Implement add."},
                {
                    "role": "assistant",
                    "content": "I will write the file.",
                    "reasoning": "The stub returns 0.",
                    "tool_calls": [
                        {
                            "call_id": "w1",
                            "name": "write_file",
                            "arguments": json.dumps({"path": "solution.py", "content": solution}),
                        },
                        {"call_id": "never-sent", "name": "echo", "arguments": "{}"},
                    ],
                },
                {"role": "tool", "call_id": "w1", "content": "wrote 31 bytes to solution.py"},
                {"role": "tool", "call_id": "never-sent", "content": "Error: tool call limit reached"},
                {"role": "simulated_user", "content": "Does it work?"},
                {"role": "assistant", "content": "Implemented add."},
            ],
        }
        stored = await review.client.put(f"/rollouts/{trace}/transcript", json=conversation, headers=GRADER)
        assert stored.status_code == 200, stored.text
        await login(review)
        page = await review.client.get(f"/review/rollouts/{trace}")
        assert page.status_code == 200
        text = page.text

    # The turns in order, the simulated customer named as such, the model and the reasoning summary.
    order = [
        text.index(marker)
        for marker in ('data-role="user"', 'data-role="assistant"', 'data-role="simulated_user"')
    ]
    assert order == sorted(order)
    assert "simulated user" in text and "policy-7b" in text and "The stub returns 0." in text
    # The logged write sits inside the assistant turn that asked for it (outcome and all), once more in the
    # timeline; the call the log never saw is marked, with what the model read.
    turn = text[text.index('data-role="assistant"') : text.index('data-role="simulated_user"')]
    assert 'id="turn-call-0"' in turn and "outcome-ok" in turn
    assert (
        'data-call-id="never-sent"' in turn
        and "not in the call log" in turn
        and "tool call limit reached" in turn
    )
    assert 'id="call-0"' in text
    # The echo call the conversation never named is listed after it.
    assert 'id="unmatched-calls"' in text and "#1 echo" in text
    # The file as code, with its diff against the workspace's starting file (not one escaped JSON string).
    assert "against the starting file" in text
    assert '<span class="diff-del">-    return 0</span>' in text
    assert '<span class="diff-add">+    return a + b</span>' in text
    assert "\\n    return a + b" not in _page(text)


async def test_a_rollout_without_a_conversation_says_how_to_store_one(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("echo", {"text": "hi"}, trace, call_id="c1")
    await login(review)
    page = await review.client.get(f"/review/rollouts/{trace}")
    assert page.status_code == 200
    assert 'id="no-conversation"' in page.text and "PUT /rollouts/{trace_id}/transcript" in page.text
    assert 'id="conversation"' not in page.text and 'id="call-0"' in page.text


def test_a_cut_diff_still_counts_every_line_added_and_removed() -> None:
    # Every line of a long file rewritten: the diff shown is cut, the +/- counts are the whole file's.
    lines = DIFF_MAX_LINES
    before = "".join(f"old {n}\n" for n in range(lines))
    after = "".join(f"new {n}\n" for n in range(lines))
    now = datetime.now(UTC)
    write = RolloutCall(
        seq=0, batch=0, tool="write_file", call_id="w1",
        arguments=json.dumps({"path": "big.txt", "content": after}), output="ok", output_bytes=2,
        outcome="ok", error=None, status_code=200, started_at=now, ended_at=now, latency_ms=1.0, worker="w",
    )  # fmt: skip
    change = file_changes([write], {"big.txt": before})[0]
    assert (change.added, change.removed) == (lines, lines)
    assert len(change.diff) == DIFF_MAX_LINES + 1 and "more lines of the diff" in change.diff[-1][1]
