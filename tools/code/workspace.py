"""A rollout's workspace: the task's starting files, copy-on-write, with the rollout's own changes on top.

The files live in the rollout's state, one collection per task (`files:<task_id>`) whose base is the
task's starting files, so every rollout of a task starts from the same files and sees only its own edits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.sdk import Base, RolloutState, ToolError
from tools.code.tasks import CodeTask

COLLECTION_PREFIX = "files:"
MAX_FILES = 50
MAX_FILE_BYTES = 256 * 1024
MAX_WORKSPACE_BYTES = 1024 * 1024
MAX_PATH_CHARS = 200
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class WorkspaceLimits:
    max_files: int = MAX_FILES
    max_file_bytes: int = MAX_FILE_BYTES
    max_workspace_bytes: int = MAX_WORKSPACE_BYTES


LIMITS = WorkspaceLimits()


def collection(task_id: str | None) -> str:
    return COLLECTION_PREFIX + (task_id or "")


def load_base(tasks: Mapping[str, CodeTask]) -> Base:
    """Every task's starting files, each task in its own collection."""
    return {collection(task.task_id): task.starting_files() for task in tasks.values()}


def task_of(item: Mapping[str, Any], tasks: Mapping[str, CodeTask]) -> CodeTask | None:
    """The task a dataset row names in `task_id`, or None (the workspace then starts empty)."""
    task_id = item.get("task_id")
    if not isinstance(task_id, str):
        return None
    return tasks.get(task_id)


def check_path(path: str) -> str:
    """`path` if it is a relative path inside the workspace, else a ToolError the model can act on."""
    if not path or len(path) > MAX_PATH_CHARS:
        raise ToolError(f"path must be 1 to {MAX_PATH_CHARS} characters, relative to the workspace")
    if path.startswith("/") or "\\" in path:
        raise ToolError(f"path {path!r} must be relative to the workspace (like 'solution.py'), not absolute")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ToolError(f"path {path!r} must stay inside the workspace: no '..', '.' or empty parts")
    bad = [part for part in parts if not _PART.fullmatch(part)]
    if bad:
        raise ToolError(
            f"path {path!r}: each part must be letters, digits, '_', '-' or '.', not starting with '.' or '-'"
        )
    if "__pycache__" in parts:
        raise ToolError("__pycache__ is not part of the workspace")
    return path


class Workspace:
    """The files of one rollout for one task, read from and written to its state."""

    def __init__(self, state: RolloutState, task: CodeTask | None) -> None:
        self.state = state
        self.task = task
        self.collection = collection(task.task_id if task else None)

    def files(self) -> dict[str, str]:
        return {path: content for path, content in self.state.items(self.collection)}

    def read(self, path: str) -> str | None:
        content = self.state.get(self.collection, path)
        return content if isinstance(content, str) else None

    def check_fits(self, changes: Mapping[str, str | None]) -> None:
        """ToolError if the workspace with `changes` applied breaks a limit."""
        files = self.files()
        for path, content in changes.items():
            if content is None:
                files.pop(path, None)
                continue
            size = len(content.encode("utf-8"))
            if size > LIMITS.max_file_bytes:
                raise ToolError(
                    f"{path} would be {size} bytes; a file may hold at most {LIMITS.max_file_bytes}"
                )
            files[path] = content
        if len(files) > LIMITS.max_files:
            raise ToolError(f"the workspace may hold at most {LIMITS.max_files} files")
        total = sum(len(content.encode("utf-8")) for content in files.values())
        if total > LIMITS.max_workspace_bytes:
            raise ToolError(
                f"the workspace would hold {total} bytes; it may hold at most {LIMITS.max_workspace_bytes}"
            )

    def check_no_collision(self, path: str) -> None:
        """ToolError if `path` names a directory of the workspace, or lies under one of its files."""
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if self.read(parent) is not None:
                raise ToolError(f"{parent} is a file, so {path} cannot be written under it")
        prefix = path + "/"
        if any(existing.startswith(prefix) for existing in self.files()):
            raise ToolError(f"{path} is a directory of the workspace; choose another name for the file")

    def write(self, path: str, content: str | None) -> None:
        self.state.put(self.collection, path, content)
