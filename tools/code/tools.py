"""The workspace tools: list, read and write files, run them in the sandbox, and a persistent interpreter."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from app.sdk import Pack, ToolContext, ToolError, ToolUnavailable
from tools.code.interpreter import (
    MARKER,
    RESTARTED,
    CellResult,
    Interpreter,
    InterpreterBusy,
    InterpreterStopped,
)
from tools.code.runtime import RUN_LIMITS, CodeResources, CodeSettings, lifespan, load_base
from tools.code.sandbox import RunResult, SandboxUnavailable, parents, under
from tools.code.tasks import EXAMPLES_FILE
from tools.code.workspace import LIMITS, Workspace, check_path, task_of

pack = Pack(
    "code",
    description=(
        "A Python workspace per rollout (HumanEval tasks): list, read and write files, run them in a "
        "sandbox, and run the docstring's examples. Graded by hidden tests."
    ),
    base=load_base,
    settings=CodeSettings,
    lifespan=lifespan,
)

MAX_ARGS = 32
MAX_ARG_CHARS = 1000
MAX_CODE_CHARS = 256 * 1024


Path_ = Annotated[
    str, Field(description="A path relative to the workspace, such as 'solution.py' or 'tests/test_x.py'.")
]


def _workspace(ctx: ToolContext) -> Workspace:
    return Workspace(ctx.state, task_of(ctx.item, ctx.resource(CodeResources).tasks))


@pack.tool(inline=True)
def list_files(ctx: ToolContext) -> list[dict[str, Any]]:
    """List the files of your workspace with their sizes in bytes."""
    files = _workspace(ctx).files()
    return [{"path": path, "bytes": len(content.encode("utf-8"))} for path, content in sorted(files.items())]


@pack.tool(inline=True)
def read_file(ctx: ToolContext, path: Path_) -> str:
    """Read a file of your workspace; answers its whole content."""
    content = _workspace(ctx).read(check_path(path))
    if content is None:
        raise ToolError(f"no file {path!r} in the workspace; list_files shows what there is")
    return content


@pack.tool(mutates=True, inline=True)
def write_file(
    ctx: ToolContext,
    path: Path_,
    content: Annotated[str, Field(description="The file's whole new content (UTF-8 text).")],
) -> str:
    """Create or replace a file of your workspace with `content`."""
    workspace = _workspace(ctx)
    check_path(path)
    workspace.check_fits({path: content})
    workspace.check_no_collision(path)
    workspace.write(path, content)
    return f"wrote {len(content.encode('utf-8'))} bytes to {path}"


@pack.tool(mutates=True)
async def run_python(
    ctx: ToolContext,
    path: Path_,
    args: Annotated[list[str] | None, Field(description="Command-line arguments (sys.argv[1:]).")] = None,
) -> dict[str, Any]:
    """Run a Python file of your workspace (`python path args...`, in the workspace directory, no network).

    Answers the exit code, stdout and stderr (each cut to 16 KiB) and the wall time. Files the run writes in
    the workspace are kept. A run is stopped after 10 seconds.
    """
    return await _run(ctx, path, args or [])


@pack.tool(mutates=True)
async def run_examples(ctx: ToolContext) -> dict[str, Any]:
    """Run examples.py (the task's docstring examples, as asserts) against your solution.py."""
    return await _run(ctx, EXAMPLES_FILE, [])


@pack.tool(mutates=True)
async def python(
    ctx: ToolContext,
    code: Annotated[
        str,
        Field(
            description="Python statements; the value of a final expression is answered, as in a notebook."
        ),
    ],
) -> dict[str, Any] | str:
    """Run Python in your own persistent interpreter, like a notebook cell (in the workspace directory, no
    network, standard library only).

    Variables, imports and files persist between calls; files it writes in the workspace are kept, and
    files other tools write are there. Answers stdout and stderr (each cut to 16 KiB), the repr of a final
    expression's value (`value`) and the traceback of an exception (`exception`). A call that runs too
    long stops the interpreter, and its state is lost.
    """
    if len(code) > MAX_CODE_CHARS:
        raise ToolError(f"code may be at most {MAX_CODE_CHARS} characters")
    resources = ctx.resource(CodeResources)
    pool = resources.interpreters
    if pool is None:
        raise ToolUnavailable("this server holds no interpreters")
    workspace = _workspace(ctx)
    interpreter: Interpreter | None = None
    try:
        async with pool.use(ctx.trace_id, ctx.state.get(*MARKER)) as (interpreter, lost):
            ctx.state.put(*MARKER, interpreter.marker())
            if lost is not None:
                return f"Error: {RESTARTED} ({lost}). A new one is ready: run the code again, with its setup."
            before = workspace.files()
            sent = interpreter.changes(before)
            async with resources.sandbox.hold_slot(ctx.trace_id):
                result = await interpreter.cell(code, sent, pool.limits)
            interpreter.cells += 1
            ctx.state.put(*MARKER, interpreter.marker())
            not_placed = [(path, why) for path, why in result.not_placed if path in sent]
            stale = frozenset(path for path, _ in not_placed)
            # A file the box holds but the rollout cannot keep is named once, not again with every cell
            # while it stays as it was (unless this cell was sent the rollout's version of it).
            shown = {path: digest for path, digest in interpreter.noted.items() if path not in sent}
            kept = _keep_files(workspace, before, result.files, stale=stale, shown=shown)
            interpreter.noted = kept.noted
            not_kept = [
                f"{path} (could not be placed in the interpreter's workspace: {why})"
                for path, why in not_placed
            ]
            not_kept += kept.not_kept
            if kept.refused:
                # The cell's changes are undone in the interpreter: those its walk skipped and those it
                # could not keep too.
                not_kept.append(
                    "(the interpreter's files are put back as the workspace holds them, with the next call)"
                )
            # The rollout's files the cell left in a version the rollout could not keep, and those its walk
            # did not see, are the rollout's again with the next call: the two never drift apart.
            interpreter.settle(workspace.files(), sent, stale, kept.refused, result.files.unseen, kept.aside)
    except InterpreterStopped as exc:
        await pool.discard(
            ctx.trace_id, "the code of an earlier call stopped it", only=interpreter, by_its_code=True
        )
        return f"Error: {exc}"
    except InterpreterBusy as exc:
        raise ToolUnavailable(str(exc)) from exc
    except (OSError, SandboxUnavailable) as exc:
        raise ToolUnavailable(f"the interpreter could not start: {exc}") from exc
    finally:
        if ctx.anonymous and interpreter is not None:
            # No later call reaches a call's own rollout: kept live, it would only push the interpreters
            # of real rollouts out at the cap.
            await pool.discard(ctx.trace_id, "", only=interpreter)
    return _cell_answer(result, not_kept)


def _cell_answer(result: CellResult, not_kept: list[str]) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "stdout": _text(result.stdout, result.stdout_total),
        "stderr": _text(result.stderr, result.stderr_total),
    }
    if result.value is not None:
        answer["value"] = result.value
    if result.exception is not None:
        answer["exception"] = result.exception
    if not_kept:
        answer["files_not_kept"] = not_kept
    return answer


async def _run(ctx: ToolContext, path: str, args: list[str]) -> dict[str, Any]:
    workspace = _workspace(ctx)
    check_path(path)
    if len(args) > MAX_ARGS or any(len(arg) > MAX_ARG_CHARS or "\0" in arg for arg in args):
        raise ToolError(f"at most {MAX_ARGS} arguments of at most {MAX_ARG_CHARS} characters, without NUL")
    before = workspace.files()
    if path not in before:
        raise ToolError(f"no file {path!r} in the workspace; list_files shows what there is")
    try:
        result = await ctx.resource(CodeResources).sandbox.run(
            before,
            ["-E", "-s", "-B", "-X", "utf8", path, *args],
            limits=RUN_LIMITS,
            collect=True,
            owner=ctx.trace_id,
        )
    except OSError as exc:
        # The sandbox could not be started here (no process slots, bwrap gone): an outage, not a
        # broken tool, so the trainer retries the call instead of discarding the rollout as broken.
        raise ToolUnavailable(f"the sandbox could not start: {exc.strerror or exc}") from exc
    except SandboxUnavailable as exc:
        raise ToolUnavailable(f"the sandbox could not start: {exc}") from exc
    return _answer(result, _keep_files(workspace, before, result).not_kept)


@dataclass
class Kept:
    """What `_keep_files` did not keep: the answer's lines, and the changes the workspace's limits refused
    as a whole (empty when they were kept)."""

    not_kept: list[str]
    refused: dict[str, str | None] = field(default_factory=dict)
    aside: set[str] = field(default_factory=set)  # files seen but not kept (not UTF-8, too large)
    noted: dict[str, str] = field(default_factory=dict)  # the files seen but not kept: their digests


def _keep_files(
    workspace: Workspace,
    before: dict[str, str],
    result: RunResult,
    *,
    stale: frozenset[str] = frozenset(),
    shown: Mapping[str, str] | None = None,
) -> Kept:
    """Apply what the run changed in the workspace; answer what could not be kept, with the reason.

    A path the run never saw is left as it is: one its walk skipped (a directory it could not list: all
    under it), one no run could hold (`RunResult.unseen`), one the run had only an older version of
    (`stale`: an interpreter's file the rollout's latest could not replace), and one whose new content
    could not be kept (not UTF-8, too large): its stored version stays. `shown`: the files not kept that an
    earlier answer named, by their content's digest; one still so is not named again."""
    not_kept = list(result.skipped)
    noted: dict[str, str] = {}

    def note(path: str, content: bytes, why: str) -> None:
        digest = noted[path] = hashlib.blake2b(content, digest_size=16).hexdigest()
        if shown is None or shown.get(path) != digest:
            not_kept.append(f"{path} ({why})")

    kept_aside = set(result.unseen) | set(stale)
    aside: set[str] = set()
    # A stale path's neighbours in the tree are the box's, not the rollout's: a file under it, or one
    # where a directory of it goes, is not taken (the rollout would hold a file and a directory of one name).
    stale_directories = {parent for path in stale for parent in parents(path)}
    after: dict[str, str] = {}
    for path, content in (result.files or {}).items():
        if under(path, stale) or path in stale_directories:
            continue
        try:
            check_path(path)
            text = content.decode("utf-8")
        except ToolError:
            note(path, content, "not a valid workspace path")
            continue
        except UnicodeDecodeError:
            note(path, content, "not UTF-8 text")
            aside.add(path)
            continue
        if len(content) > LIMITS.max_file_bytes:
            note(path, content, f"over {LIMITS.max_file_bytes} bytes")
            aside.add(path)
            continue
        after[path] = text
    kept_aside |= aside
    if result.files is None:
        return Kept(not_kept, noted=noted)
    changes: dict[str, str | None] = {path: text for path, text in after.items() if before.get(path) != text}
    if result.files_complete:
        for path in before:
            if path not in after and not under(path, kept_aside):
                changes[path] = None  # the run deleted it
    else:
        # What the walk did list still proves some files gone: one that is now a directory holding a
        # listed file, and one under a name that is now a listed file.
        directories = {parent for path in after for parent in parents(path)}
        for path in before:
            gone = path in directories or any(parent in after for parent in parents(path))
            if gone and path not in after and not under(path, kept_aside):
                changes[path] = None
        not_kept.append(
            "(the walk of the files stopped at a limit: files it did not list were left as they were)"
        )
    try:
        # A run's own walk keeps within these limits; an interpreter's report comes from a process the
        # cells control, so the workspace's limits are checked here, whoever reported.
        workspace.check_fits(changes)
    except ToolError as exc:
        not_kept.append(f"(no change to the files was kept: {exc.message})")
        return Kept(not_kept, changes, aside, noted)
    for path, change in changes.items():
        workspace.write(path, change)
    return Kept(not_kept, aside=aside, noted=noted)


def _text(data: bytes, total: int) -> str:
    text = data.decode("utf-8", errors="replace")
    if total > len(data):
        text += f"\n[output truncated: {total - len(data)} of {total} bytes cut]"
    return text


def _answer(result: RunResult, not_kept: list[str]) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "exit_code": result.exit_code,
        "stdout": _text(result.stdout.data, result.stdout.total),
        "stderr": _text(result.stderr.data, result.stderr.total),
        "wall_seconds": round(result.wall_seconds, 3),
    }
    if result.timed_out:
        answer["error"] = (
            f"stopped at its time limit: {RUN_LIMITS.wall_seconds:g} seconds (wall-clock limit) "
            f"or {RUN_LIMITS.cpu_seconds} seconds of CPU time"
        )
    elif result.output_overflow:
        answer["error"] = "stopped: it wrote more output than the limit"
    elif result.memory_exceeded:
        answer["error"] = "a process was killed: the run used more memory than its limit"
    if result.files is None:
        if "error" in answer:
            not_kept = [*not_kept, "(the run was stopped before its files were read: no change was kept)"]
        else:
            answer["error"] = "the run stopped its own supervisor: the files it wrote were not kept"
    if not_kept:
        answer["files_not_kept"] = not_kept
    return answer


@pack.starting_files
def files_at_start(resources: CodeResources, item: Mapping[str, Any]) -> dict[str, str]:
    """The workspace a rollout of `item` starts with: its task's starting files (none for no task)."""
    task = task_of(item, resources.tasks)
    return task.starting_files() if task is not None else {}
