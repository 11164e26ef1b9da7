"""The sandbox holds what a run does: disk, memory, /dev/shm, slots, odd file names, colliding paths,
what dead workers left, and an outage of the sandbox itself is a 503, never a score or a model error."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.code.conftest import CodeClient, all_tasks, served_resources
from tests.code.test_isolation import processes_with
from tests.code.test_startup import fake_bwrap
from tests.conftest import new_trace
from tools.code import check, freezer, memory, sandbox
from tools.code.runtime import CodeResources

TASK = "HumanEval/0"
MiB = 1024 * 1024
one_backend = pytest.mark.parametrize("backend", ["embedded"])


@pytest.fixture(params=["warm", "cold"])
def sandbox_path(request: pytest.FixtureRequest) -> str:
    """Every test here that serves the code pack holds on both paths: warm forks, and a bwrap per run."""
    return str(request.param)


def served_sandbox(code: CodeClient) -> sandbox.Sandbox:
    """The sandbox the app's code pack built at start-up."""
    resources = served_resources(code.http)["code"]
    assert isinstance(resources, CodeResources)
    return resources.sandbox


def deep_tree(levels: int) -> str:
    return (
        "import os\n"
        f"for _ in range({levels}):\n"
        "    os.mkdir('d')\n"
        "    os.chdir('d')\n"
        "open('bottom.txt', 'w').write('x')\n"
        "print('built')\n"
    )


@one_backend
async def test_a_deep_tree_is_a_clear_answer_and_leaves_nothing_on_the_host(
    code_app: Any, backend: str
) -> None:
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "deep.py", deep_tree(1100), task_id=TASK)
        first = await code.run(trace, "deep.py", task_id=TASK)
        again = await code.run(trace, "deep.py", task_id=TASK)  # what the first left does not break it
        listed = json.loads(await code.call(trace, "list_files", {}, task_id=TASK))
        left_on_host = list(served_sandbox(code).root.iterdir())
    assert first["exit_code"] == 0 and first["stdout"] == "built\n", first
    assert any("path too long" in entry for entry in first["files_not_kept"])
    assert again["exit_code"] == 0
    assert {entry["path"] for entry in listed} == {"deep.py", "examples.py", "solution.py"}
    assert left_on_host == []


@one_backend
async def test_the_workspace_has_a_size_cap(code_app: Any, backend: str) -> None:
    script = (
        "import errno\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(64):\n"  # 32 MiB at most, in files under the per-file limit
        "        with open(f'blob{i}', 'wb') as f:\n"
        "            f.write(b'x' * 512 * 1024)\n"
        "        written += 512 * 1024\n"
        "    print('no limit', written)\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno], written)\n"
    )
    async with code_app(code={"workspace_bytes": 8 * MiB}) as code:
        trace = new_trace()
        await code.write(trace, "fill.py", script, task_id=TASK)
        ran = await code.run(trace, "fill.py", task_id=TASK)
    outcome, written = ran["stdout"].split()
    assert outcome == "ENOSPC", ran
    assert int(written) <= 8 * MiB


def test_removing_a_deep_unreadable_tree_never_raises(tmp_path: Path) -> None:
    top = tmp_path / "ws"
    current = top
    current.mkdir()
    for _ in range(1100):
        current = current / "d"
        current.mkdir()
    depth_reached = len(current.relative_to(top).parts)
    (current / "file").write_text("x")
    current.chmod(0o000)  # a run may leave a directory nobody can list
    sandbox.remove_tree(top)
    sandbox.remove_tree(top)  # gone already: still no error
    assert depth_reached > 1000
    assert not top.exists()


def machine_has_cgroup_v1_memory() -> bool:
    return (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").is_file()
        and not Path("/sys/fs/cgroup/cgroup.controllers").is_file()
        and os.geteuid() == 0
    )


@pytest.mark.skipif(
    not machine_has_cgroup_v1_memory(), reason="this machine has no cgroup v1 memory controller"
)
@one_backend
async def test_the_memory_cap_mechanism_of_this_machine_is_found_and_logged(
    code_app: Any, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sparring.packs.code.sandbox")
    async with code_app() as code:
        active = served_sandbox(code).memory
    assert active.mechanism == "cgroup-v1" and active.worker is not None
    assert any("(cgroup-v1)" in record.getMessage() for record in caplog.records)


@pytest.mark.skipif(freezer.v2_root() is None, reason="this machine mounts no cgroup v2 hierarchy")
@one_backend
async def test_the_interpreters_freezer_of_this_machine_is_found_and_logged_and_left_clean(
    code_app: Any, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On this machine (memory on cgroup v1, the v2 hierarchy beside it) each interpreter gets a v2 cgroup
    of its own for the freezer; every one is removed when its interpreter stops."""
    caplog.set_level(logging.INFO, logger="sparring.packs.code.sandbox")
    async with code_app() as code:
        active = served_sandbox(code).freezer
        memory_mechanism = served_sandbox(code).memory.mechanism
        trace = new_trace()
        answer = await code.call(trace, "python", {"code": "1 + 1"}, task_id=TASK)
        groups = active.worker or served_sandbox(code).memory.worker
        assert groups is not None
        during = sorted(path.name for path in groups.iterdir() if path.is_dir())
    assert json.loads(answer)["value"] == "2"
    assert active.mechanism == ("memory-cgroup" if memory_mechanism == "cgroup-v2" else "own-cgroup")
    assert any("frozen between calls by a cgroup" in record.getMessage() for record in caplog.records)
    assert during, during  # the live interpreter's (and the spares')
    # The worker's own cgroup is shared by the sandboxes this process builds (removed at its exit).
    assert not [path for path in groups.iterdir() if path.is_dir()]


@one_backend
async def test_a_runs_processes_share_one_memory_cap(code_app: Any, backend: str) -> None:
    # Three children each try to hold 80 MiB at the same time under a cap of 128 MiB for the whole run.
    script = (
        "import subprocess, sys\n"
        'hold = \'import sys; block = bytearray(b"\\\\x01") * (80 << 20); print("held", flush=True); '
        "sys.stdin.read()'\n"
        "children = [subprocess.Popen([sys.executable, '-c', hold], stdin=subprocess.PIPE, "
        "stdout=subprocess.PIPE) for _ in range(3)]\n"
        "held = [child.stdout.readline().strip() for child in children]\n"
        "for child in children:\n"
        "    child.stdin.close()\n"
        "    child.wait()\n"
        # A child killed after it printed counts for nothing: only children that held their memory and
        # were still alive to exit normally when told to held it at the same time as the others.
        "print(sum(line == b'held' and child.returncode == 0 for line, child in zip(held, children)))\n"
    )
    async with code_app(code={"run_memory_bytes": 128 * MiB}) as code:
        trace = new_trace()
        await code.write(trace, "hog.py", script, task_id=TASK)
        ran = await code.run(trace, "hog.py", task_id=TASK)
    held = ran["stdout"].strip()
    assert held in ("", "0", "1"), ran  # never two at once (the parent may be the one killed)
    assert "more memory than its limit" in ran["error"], ran


@one_backend
async def test_dev_shm_is_capped_and_dev_is_read_only(code_app: Any, backend: str) -> None:
    script = (
        "import errno\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'/dev/shm/blob{i}', 'wb') as f:\n"
        "            f.write(b'x' * 512 * 1024)\n"
        "        written += 512 * 1024\n"
        "    print('no limit', written)\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno], written)\n"
        "try:\n"
        "    open('/dev/blob', 'w')\n"
        "    print('dev writable')\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
    )
    async with code_app(code={"shm_bytes": 4 * MiB}) as code:
        trace = new_trace()
        await code.write(trace, "shm.py", script, task_id=TASK)
        ran = await code.run(trace, "shm.py", task_id=TASK)
    shm, dev = ran["stdout"].splitlines()
    outcome, written = shm.split()
    assert outcome == "ENOSPC" and int(written) <= 4 * MiB, ran
    assert dev in ("EROFS", "EACCES"), ran


def test_what_gone_workers_left_is_swept_at_start_up(tmp_path: Path) -> None:
    temp = Path(tempfile.gettempdir())
    own = memory.process_identity(os.getpid())
    parent = memory.process_identity(os.getppid())
    assert own is not None and parent is not None
    gone_identity = f"{os.getpid()}-1"  # this pid with another start time: a worker that is gone
    gone_root = temp / f"{sandbox.ROOT_PREFIX}{gone_identity}-abcdefgh"
    live_root = temp / f"{sandbox.ROOT_PREFIX}{parent}-abcdefgh"
    workspace = gone_root / "ws-left"
    (workspace / "a" / "b").mkdir(parents=True)
    (workspace / "a" / "b" / "solution.py").write_text("x")
    live_root.mkdir()
    cap, _ = memory.detect(64 * MiB)
    gone_group: Path | None = None
    if cap.worker is not None:
        gone_group = cap.worker.parent / f"sparring-{gone_identity}"
        (gone_group / "run-left").mkdir(parents=True)
    frozen, _ = freezer.detect(cap)
    gone_freezer: Path | None = None
    elsewhere: Path | None = None  # a worker of another pid namespace: its pid means nothing here
    if frozen.worker is not None:
        gone_freezer = frozen.worker.parent / freezer.worker_name(gone_identity)
        (gone_freezer / "session-left").mkdir(parents=True)
        elsewhere = frozen.worker.parent / f"sparring-1-{gone_identity}"
        (elsewhere / "session-theirs").mkdir(parents=True)
    try:
        built = sandbox.create("bwrap", python=None, home=tmp_path)
        built.close()
        assert not gone_root.exists()
        assert live_root.exists()  # its worker still runs
        if gone_group is not None:
            assert not gone_group.exists()
        if gone_freezer is not None:
            assert not gone_freezer.exists()
        if elsewhere is not None:
            assert (elsewhere / "session-theirs").exists()
    finally:
        if elsewhere is not None:
            memory.release(elsewhere / "session-theirs")
            memory.release(elsewhere)
        sandbox.remove_tree(live_root)
        sandbox.remove_tree(gone_root)


@one_backend
async def test_a_busy_rollout_cannot_take_every_slot(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rollout's tool calls that change files already wait for each other; its grades do not. A
    # solution that spins in a process of its own (named by the marker) holds a slot per grade.
    monkeypatch.setattr(check, "GRADE_LIMITS", sandbox.Limits(wall_seconds=10.0, cpu_seconds=10))
    marker = f"spin_{uuid.uuid4().hex}"
    spinner = (
        f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])\n"
    )
    async with code_app(code={"sandbox_slots": 2, "sandbox_slots_per_rollout": 1}) as code:
        busy, other = new_trace(), new_trace()
        await code.write(busy, "solution.py", spinner, task_id=TASK)
        await code.write(other, "quick.py", "print(1)\n", task_id=TASK)
        grades = [asyncio.ensure_future(code.grade(busy, TASK)) for _ in range(3)]
        most = 0
        quick: dict[str, Any] | None = None
        busy_left_when_quick_ended = 0
        while not all(grade.done() for grade in grades):
            spinning = len(processes_with(marker))
            most = max(most, spinning)
            if spinning and quick is None:
                # The busy rollout holds one slot: another rollout's run gets the other at once.
                quick = await code.run(other, "quick.py", task_id=TASK)
                busy_left_when_quick_ended = sum(not grade.done() for grade in grades)
            await asyncio.sleep(0.1)
        scores = await asyncio.gather(*grades)
    assert scores == [0.0, 0.0, 0.0]
    assert most == 1  # never two runs of the busy rollout at once
    assert quick is not None and quick["stdout"] == "1\n"
    assert busy_left_when_quick_ended >= 2


@one_backend
async def test_a_file_name_that_is_not_utf8_is_escaped(code_app: Any, backend: str) -> None:
    script = "open(b'/workspace/\\xff', 'w').write('x')\nopen('kept.txt', 'w').write('y')\n"
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "odd.py", script, task_id=TASK)
        ran = await code.run(trace, "odd.py", task_id=TASK)
        kept = await code.call(trace, "read_file", {"path": "kept.txt"}, task_id=TASK)
    assert ran["exit_code"] == 0, ran
    assert any(entry.startswith("\\xff (") for entry in ran["files_not_kept"]), ran
    assert kept == "y"


@one_backend
async def test_write_file_refuses_a_path_that_collides(code_app: Any, backend: str) -> None:
    async with code_app() as code:
        trace = new_trace()
        under_a_file = await code.write(trace, "solution.py/x.py", "x", task_id=TASK)
        await code.write(trace, "pkg/a.py", "A = 1\n", task_id=TASK)
        over_a_directory = await code.write(trace, "pkg", "x", task_id=TASK)
        ran = await code.run(trace, "solution.py", task_id=TASK)
    assert under_a_file.startswith("Error: solution.py is a file"), under_a_file
    assert over_a_directory.startswith("Error: pkg is a directory"), over_a_directory
    assert ran["exit_code"] == 0


@one_backend
async def test_colliding_paths_from_two_collections_still_grade(code_app: Any, backend: str) -> None:
    # A rollout's edits made without a task id join the task's files at grading: a collision between
    # them is the model's doing, so it is left out of the run, never an outage.
    task = all_tasks()[TASK]
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "solution.py/x.py", "x", task_id=None)
        await code.write(trace, "solution.py", task.gold_solution, task_id=TASK)
        score = await code.grade(trace, TASK)
    assert score == 1.0


async def test_a_sandbox_that_cannot_run_makes_the_grade_unavailable(
    code_app: Any, sandbox_path: str
) -> None:
    # A broken bwrap reaches the runs that start one: the cold path (the warm path's parent died: test_warm).
    task = all_tasks()[TASK]
    fake = fake_bwrap()
    async with code_app({"warm": False}) as code:
        trace = new_trace()
        await code.write(trace, "solution.py", task.gold_solution, task_id=TASK)
        body = {"sample": {"output_text": "done"}, "item": {"task_id": TASK}, "trace_id": trace}
        real = served_sandbox(code)
        real_bwrap = real.bwrap
        answers = []
        try:
            for broken in (str(fake), "/nonexistent/bwrap"):  # bwrap failing, bwrap gone
                real.bwrap = broken
                answers.append(await code.http.post("/grade/code", json=body))
                tool = await code.http.post(
                    "/tools/run_python",
                    json={
                        "call_id": f"c-{len(answers)}",
                        "trace_id": trace,
                        "item": {"task_id": TASK},
                        "arguments": {"path": "solution.py", "args": None},
                    },
                )
                assert tool.status_code == 503, tool.text
        finally:
            real.bwrap = real_bwrap
            fake.unlink()
            fake.parent.rmdir()
        healed = await code.grade(trace, TASK)
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "grader_unavailable"
        assert answer.headers["Retry-After"]
    assert healed == 1.0


@one_backend
async def test_files_the_walk_did_not_list_are_not_taken_as_deleted(code_app: Any, backend: str) -> None:
    # 120 new files: past the 50 kept, more are left out than the report lists one by one.
    script = "for i in range(120):\n    open(f'a{i:03}.txt', 'w').write('x')\n"
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "many.py", script, task_id=TASK)
        ran = await code.run(trace, "many.py", task_id=TASK)
        solution = await code.call(trace, "read_file", {"path": "solution.py"}, task_id=TASK)
        runner = await code.call(trace, "read_file", {"path": "many.py"}, task_id=TASK)
    assert ran["exit_code"] == 0
    assert any("left as they were" in entry for entry in ran["files_not_kept"]), ran
    assert solution == all_tasks()[TASK].prompt
    assert runner == script


@one_backend
async def test_a_run_that_kills_every_process_it_can_is_still_an_answer(
    code_app: Any, backend: str, sandbox_path: str
) -> None:
    script = "import os, signal\nprint('bye', flush=True)\nos.kill(-1, signal.SIGKILL)\n"
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "killall.py", script, task_id=TASK)
        ran = await code.run(trace, "killall.py", task_id=TASK)
        again = await code.run(trace, "solution.py", task_id=TASK)
    assert ran["stdout"] == "bye\n"
    if sandbox_path == "cold":  # it killed its supervisor
        assert "supervisor" in ran["error"], ran
    else:  # the run's init is out of its reach (pid 1 of its namespace): nothing else to kill, as Linux says
        assert ran["exit_code"] == 1, ran
        assert ran["stderr"].startswith('Traceback (most recent call last):\n  File "/workspace/killall.py"')
        assert ran["stderr"].endswith("ProcessLookupError: [Errno 3] No such process\n"), ran
    assert again["exit_code"] == 0
