"""The sandbox through the tools: rollouts cannot see each other, the host, its network or its processes;
runs leave no process behind; many runs at once all get their own answers."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.code.conftest import gather_bounded
from tests.conftest import new_trace
from tools.code import tools
from tools.code.sandbox import Limits

TASK = "HumanEval/0"


@pytest.fixture(params=["warm", "cold"])
def sandbox_path(request: pytest.FixtureRequest) -> str:
    """Every test here that serves the code pack holds on both paths: warm forks, and a bwrap per run."""
    return str(request.param)


def processes_with(marker: str) -> list[int]:
    """Host processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


def host_paths_existing(paths: list[str]) -> list[str]:
    return [path for path in paths if Path(path).exists()]


async def test_a_rollout_cannot_read_another_rollouts_files(code_app: Any) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    search = (
        "import os\n"
        f"needle = {secret[::-1]!r}[::-1].encode()\n"
        "hits = []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root == '/':\n"
        "        dirs[:] = [d for d in dirs if d not in ('proc', 'sys', 'dev', 'usr')]\n"
        "    for name in files:\n"
        "        try:\n"
        "            with open(os.path.join(root, name), 'rb') as f:\n"
        "                if needle in f.read(1 << 20):\n"
        "                    hits.append(os.path.join(root, name))\n"
        "        except OSError:\n"
        "            pass\n"
        "print(hits)\n"
    )
    async with code_app() as code:
        owner, other = new_trace(), new_trace()
        await code.write(owner, "secret.txt", secret, task_id=TASK)
        await code.write(other, "search.py", search, task_id=TASK)
        mine = await code.write(owner, "search.py", search, task_id=TASK)
        in_owner = await code.run(owner, "search.py", task_id=TASK)
        in_other = await code.run(other, "search.py", task_id=TASK)
        read = await code.call(other, "read_file", {"path": "secret.txt"}, task_id=TASK)
    assert mine.startswith("wrote")
    assert in_owner["stdout"].strip() == "['/workspace/secret.txt']"  # the search finds it where it is
    assert in_other["stdout"].strip() == "[]"
    assert read.startswith("Error: no file 'secret.txt'")


async def test_a_run_cannot_reach_a_port_on_the_hosts_loopback(code_app: Any) -> None:
    connections: list[str] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append("connected")
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    script = (
        "import socket\n"
        "for host in ('127.0.0.1', 'localhost', '::1', '10.0.2.2', '8.8.8.8'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=2).close()\n"
        "        print(host, 'connected')\n"
        "    except OSError as exc:\n"
        "        print(host, 'refused', type(exc).__name__)\n"
    )
    try:
        async with code_app() as code:
            trace = new_trace()
            await code.write(trace, "net.py", script, task_id=TASK)
            ran = await code.run(trace, "net.py", task_id=TASK)
    finally:
        server.close()
        await server.wait_closed()
    assert ran["exit_code"] == 0, ran
    assert "connected" not in ran["stdout"], ran["stdout"]
    assert ran["stdout"].count("refused") == 5
    assert connections == []


async def test_a_run_cannot_write_outside_its_workspace(code_app: Any) -> None:
    marker = f"sparring-escape-{uuid.uuid4().hex}"
    targets = ["/usr/" + marker, "/etc/" + marker, "/" + marker, "/workspace/../" + marker, "/tmp/" + marker]
    script = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('x')\n"
        "        print(path, 'written')\n"
        "    except OSError as exc:\n"
        "        print(path, 'refused', exc.errno)\n"
    )
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "escape.py", script, task_id=TASK)
        ran = await code.run(trace, "escape.py", task_id=TASK)
    lines = ran["stdout"].splitlines()
    assert [line.split()[1] for line in lines] == ["refused", "refused", "refused", "refused", "written"]
    # /tmp is the run's own: nothing reached the host.
    assert host_paths_existing([path + marker for path in ("/usr/", "/etc/", "/", "/tmp/")]) == []


async def test_a_run_cannot_see_host_processes(code_app: Any, sandbox_path: str) -> None:
    script = (
        "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\nprint(os.getuid())\n"
    )
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "ps.py", script, task_id=TASK)
        ran = await code.run(trace, "ps.py", task_id=TASK)
    pids_line, uid_line = ran["stdout"].splitlines()
    pids = [int(p) for p in pids_line.strip("[]").split(", ")]
    if sandbox_path == "cold":
        assert pids == [1, 2, 3]  # the sandbox's init, the supervisor and the run itself
    else:
        assert pids == [1, 2]  # the run's own init and the run itself
    assert uid_line == "65534"  # an unprivileged uid


@pytest.mark.parametrize("backend", ["real"])
async def test_a_timed_out_run_leaves_no_process_behind(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tools, "RUN_LIMITS", Limits(wall_seconds=2.0, cpu_seconds=10))
    marker = f"sparring-leftover-{uuid.uuid4().hex}"
    script = (
        "import os, subprocess, sys, time\n"
        f"marker = {marker!r}\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', marker])\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', marker])\n"
        "    os._exit(0)\n"
        "print('started', flush=True)\n"
        "if sys.argv[1] == 'hang':\n"
        "    while True:\n"
        "        time.sleep(1)\n"
    )
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "spawn.py", script, task_id=TASK)
        hung = await code.run(trace, "spawn.py", task_id=TASK, args=["hang"])
        left_after_timeout = processes_with(marker)
        finished = await code.run(trace, "spawn.py", task_id=TASK, args=["exit"])
        left_after_exit = processes_with(marker)
    assert hung["exit_code"] is None and "wall-clock limit" in hung["error"]
    assert hung["stdout"] == "started\n"
    assert finished["exit_code"] == 0 and finished["stdout"] == "started\n"
    assert left_after_timeout == [] and left_after_exit == []


@pytest.mark.parametrize("backend", ["real"])
async def test_a_run_stopped_at_its_cpu_limit_is_timed_out(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel kills a busy loop at 1 CPU-second, long before the wall clock's 20: that is a timeout
    # too (a grader's `timeout` flag must not depend on which of the two limits came first).
    monkeypatch.setattr(tools, "RUN_LIMITS", Limits(wall_seconds=20.0, cpu_seconds=1))
    async with code_app() as code:
        trace = new_trace()
        await code.write(
            trace, "spin.py", "print('spinning', flush=True)\nwhile True:\n    pass\n", task_id=TASK
        )
        await code.write(
            trace, "killed.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", task_id=TASK
        )
        # A child that spins to its own limit, waited for; then the program kills itself.
        await code.write(
            trace,
            "waited.py",
            "import os, signal, subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', 'while True: pass'])\n"
            "print('child ended', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
            task_id=TASK,
        )
        spun = await code.run(trace, "spin.py", task_id=TASK)
        killed = await code.run(trace, "killed.py", task_id=TASK)
        waited = await code.run(trace, "waited.py", task_id=TASK)
    assert spun["exit_code"] is None and "1 seconds of CPU time" in spun["error"], spun
    assert spun["stdout"] == "spinning\n" and spun["wall_seconds"] < 20
    # A run killed by a signal without using its CPU time is not a timeout.
    assert killed["exit_code"] == 137 and "error" not in killed, killed
    # Nor is one whose child used that much: the limit is each process's own.
    assert waited["stdout"] == "child ended\n", waited
    assert waited["exit_code"] == 137 and "error" not in waited, waited


@pytest.mark.parametrize("backend", ["real"])
async def test_parallel_runs_of_one_rollout_keep_every_file(code_app: Any, backend: str) -> None:
    script = "import sys\nopen(f'out_{sys.argv[1]}.txt', 'w').write(sys.argv[1] * 3)\nprint(sys.argv[1])\n"
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "job.py", script, task_id=TASK)
        runs = await asyncio.gather(
            *(code.run(trace, "job.py", task_id=TASK, args=[str(i)]) for i in range(8))
        )
        listed = await code.call(trace, "list_files", {}, task_id=TASK)
        kept = await code.call(trace, "read_file", {"path": "out_5.txt"}, task_id=TASK)
    assert [run["stdout"] for run in runs] == [f"{i}\n" for i in range(8)]
    paths = {entry["path"] for entry in json.loads(listed)}
    assert {f"out_{i}.txt" for i in range(8)} <= paths, listed
    assert kept == "555"


@pytest.mark.parametrize("backend", ["real"])
async def test_fifty_rollouts_run_at_once(code_app: Any, backend: str) -> None:
    script = "import sys\nprint(sum(range(int(sys.argv[1]))))\n"
    async with code_app() as code:
        traces = [new_trace() for _ in range(50)]
        await gather_bounded(50, *(code.write(t, "sum.py", script, task_id=TASK) for t in traces))
        runs = await asyncio.gather(
            *(code.run(t, "sum.py", task_id=TASK, args=[str(i)]) for i, t in enumerate(traces))
        )
    assert [run["stdout"] for run in runs] == [f"{sum(range(i))}\n" for i in range(50)]
    assert all(run["exit_code"] == 0 for run in runs)
