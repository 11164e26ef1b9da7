"""Stopping the processes the sandbox started keeps their exit status for the one waiting for them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tools.code.sandbox import kill_process


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_killing_a_process_that_ended_leaves_it_to_its_waiter() -> None:
    """A process that ended and was not reaped yet (its waiter, asyncio's child watcher, has not run):
    the kill neither reaps it nor changes its status, so the waiter reads the status it ended with."""
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    for _ in range(500):
        if _state(pid) == "Z":
            break
        time.sleep(0.01)
    assert _state(pid) == "Z"
    process: Any = SimpleNamespace(pid=pid, returncode=None)
    kill_process(process)
    assert _state(pid) == "Z"  # still there for its waiter
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


async def test_killing_a_running_process_stops_it() -> None:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    kill_process(process)
    assert await asyncio.wait_for(process.wait(), 10) == -signal.SIGKILL
    kill_process(process)  # known to have ended: nothing is sent
