"""The warm path: runs forked from a parent per worker keep nothing of each other, the parent is replaced
when it dies (the calls in flight are 503s) and after its runs, and /healthz says which path is active."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.code.conftest import all_tasks, served_resources
from tests.conftest import new_trace
from tools.code import check, warm
from tools.code.runtime import RUN_LIMITS, CodeResources, CodeSettings, build_sandbox
from tools.code.sandbox import Limits, RunResult, Sandbox
from tools.code.warm import WarmRunner

TASK = "HumanEval/0"
ARGS = ["-E", "-s", "-B", "-X", "utf8"]


@contextlib.asynccontextmanager
async def started_warm(sandbox: Sandbox, spare_slots: int = warm.SPARE_SLOTS) -> AsyncIterator[WarmRunner]:
    """`sandbox` with its warm parent started (as the code pack's lifespan does); both closed after."""
    try:
        runner = WarmRunner(sandbox, max_runs=500, spare_slots=spare_slots)
        assert await runner.start(), runner.why_cold
        sandbox.warm = runner
        try:
            yield runner
        finally:
            sandbox.warm = None
            await runner.close()
    finally:
        sandbox.close()


@pytest.fixture
async def warm_sandbox(tmp_path: Path) -> AsyncIterator[Sandbox]:
    """The real bwrap sandbox with its warm parent started."""
    sandbox = build_sandbox(CodeSettings(), home=tmp_path, binds_loopback=True)
    async with started_warm(sandbox):
        yield sandbox


@pytest.fixture
async def one_slot_sandbox(tmp_path: Path) -> AsyncIterator[Sandbox]:
    """The warm sandbox without a spare slot: every run, one at a time, goes to the same slot."""
    sandbox = build_sandbox(CodeSettings(), home=tmp_path, binds_loopback=True)
    async with started_warm(sandbox, spare_slots=0):
        yield sandbox


async def run(sandbox: Sandbox, source: str, files: dict[str, str] | None = None) -> RunResult:
    result = await sandbox.run(
        {"main.py": source, **(files or {})}, [*ARGS, "main.py"], limits=RUN_LIMITS, collect=True
    )
    assert result.exit_code == 0, result.stderr.data.decode()
    return result


def lines(result: RunResult) -> list[str]:
    return result.stdout.data.decode().splitlines()


async def test_no_file_environment_or_module_state_crosses_runs(warm_sandbox: Sandbox) -> None:
    assert warm_sandbox.warm is not None
    first = await run(
        warm_sandbox,
        "import builtins, json, os, sys, collections\n"
        "open('/tmp/left', 'w').write('x')\n"
        "open('/dev/shm/left', 'w').write('x')\n"
        "open('/workspace/left.txt', 'w').write('x')\n"
        "os.environ['LEFT'] = '1'\n"
        "json.dumps = lambda *a, **k: 'patched'\n"
        "collections.LEFT = 1\n"
        "builtins.LEFT = 1\n"
        "sys.modules['left'] = sys\n"
        "sys.path.append('/left')\n"
        "LEFT = 1\n"
        "print(json.dumps([1]), sorted(os.listdir('/tmp')))\n",
    )
    assert lines(first) == ["patched ['left']"]
    assert "left.txt" in (first.files or {})
    second = await run(
        warm_sandbox,
        "import builtins, json, os, sys, collections\n"
        "print(*(sorted(os.listdir(d)) for d in ('/tmp', '/dev/shm', '/workspace')))\n"
        "print(os.environ.get('LEFT'), json.dumps([1]), hasattr(collections, 'LEFT'))\n"
        "print(hasattr(builtins, 'LEFT'), 'left' in sys.modules, '/left' in sys.path)\n"
        "print(sorted(k for k in globals() if not k.startswith('__')))\n"
        "print(sorted(os.environ))\n",
    )
    assert lines(second) == [
        "[] [] ['main.py']",
        "None [1] False",
        "False False False",
        "['builtins', 'collections', 'json', 'os', 'sys']",
        "['HOME', 'LANG', 'PATH', 'TMPDIR']",
    ]
    assert warm_sandbox.warm.runs == 3  # the probe and both runs forked from the warm parent


async def test_files_a_run_left_open_are_written_as_at_pythons_exit(warm_sandbox: Sandbox) -> None:
    """Files left open and unflushed, by a module the run imported or on a module the parent had already
    imported, hold what was written once the run ends, as `python`'s exit leaves them."""
    helper = "log = open('log.txt', 'w')\nlog.write('written by a module of the run')\n"
    main = (
        "import helper, json\n"
        "json.kept = open('kept.txt', 'w')\n"
        "json.kept.write('held by a module of the parent')\n"
        "raw = open('raw.bin', 'wb')\n"
        "raw.write(b'buffered bytes')\n"
        "print('done')\n"
    )
    result = await run(warm_sandbox, main, {"helper.py": helper})
    assert result.files is not None
    assert result.files["log.txt"] == b"written by a module of the run"
    assert result.files["kept.txt"] == b"held by a module of the parent"
    assert result.files["raw.bin"] == b"buffered bytes"
    assert lines(result) == ["done"]


async def test_a_file_a_blocked_thread_holds_never_keeps_the_run_from_ending(warm_sandbox: Sandbox) -> None:
    """A daemon thread is blocked writing to a pipe nobody reads when the program ends: python's exit
    abandons it (and its file), and so does the run's, which ends with its own output."""
    program = (
        "import os, threading, time\n"
        "_, end = os.pipe()\n"
        "stuck = os.fdopen(end, 'wb')\n"
        "def feed():\n"
        "    while True:\n"
        "        stuck.write(b'x' * 65536)\n"
        "threading.Thread(target=feed, daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "print('main done')\n"
    )
    result = await warm_sandbox.run(
        {"main.py": program}, [*ARGS, "main.py"], limits=Limits(wall_seconds=10.0)
    )
    assert (result.exit_code, result.timed_out, lines(result)) == (0, False, ["main done"])


async def test_a_runs_main_module_is_set_up_as_pythons(warm_sandbox: Sandbox) -> None:
    """`__main__`'s loader, spec, package and file are what `python` gives a script and `-c` code (the cold
    path runs `python` itself)."""
    script = (
        "import sys\n"
        "main = sys.modules['__main__']\n"
        "loader = main.__loader__\n"
        "print(getattr(loader, '__name__', type(loader).__name__), getattr(loader, 'path', None))\n"
        "print(main.__spec__, main.__package__, main.__name__, globals().get('__file__'))\n"
    )
    answers = {}
    assert warm_sandbox.warm is not None
    for path in ("warm", "cold"):
        warm_sandbox.warm.path = path
        try:
            as_file = await run(warm_sandbox, script)
            as_code = await warm_sandbox.run({}, ["-I", "-c", script], limits=Limits())
        finally:
            warm_sandbox.warm.path = "warm"
        answers[path] = (lines(as_file), lines(as_code))
    assert answers["warm"] == answers["cold"]
    assert answers["warm"][0][0] == "SourceFileLoader /workspace/main.py"
    assert answers["warm"][1][0] == "BuiltinImporter None"


async def test_each_run_draws_its_own_random_state(warm_sandbox: Sandbox) -> None:
    script = "import random, os\nprint(random.random(), random.getrandbits(64), os.urandom(8).hex())\n"
    draws = [lines(await run(warm_sandbox, script))[0] for _ in range(3)]
    firsts = {draw.split()[0] for draw in draws}
    bits = {draw.split()[1] for draw in draws}
    urandoms = {draw.split()[2] for draw in draws}
    assert len(firsts) == len(bits) == len(urandoms) == 3, draws


async def test_concurrent_runs_see_nothing_of_each_other(warm_sandbox: Sandbox) -> None:
    # Two runs at once (two slots of one parent): neither sees the other's processes, files, /tmp, IPC,
    # loopback or terminals.
    script = (
        "import os, sys, time\n"
        "name = sys.argv[1]\n"
        "open(f'/tmp/{name}', 'w').write(name)\n"
        "import socket\n"
        "listener = socket.create_server(('127.0.0.1', 4000))\n"  # the same port in both: two loopbacks
        "terminal = os.openpty()\n"
        "time.sleep(0.5)\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(sorted(os.listdir('/tmp')), sorted(os.listdir('/workspace')))\n"
        "print(open('/proc/sysvipc/msg').read().count('\\n'))\n"
        "print(os.ttyname(terminal[1]), sorted(os.listdir('/dev/pts')))\n"
    )

    async def one(name: str) -> list[str]:
        result = await warm_sandbox.run(
            {"main.py": script, f"{name}.txt": name}, [*ARGS, "main.py", name], limits=RUN_LIMITS
        )
        assert result.exit_code == 0, result.stderr.data.decode()
        return lines(result)

    first, second = await asyncio.gather(one("a"), one("b"))
    assert first == ["[1, 2]", "['a'] ['a.txt', 'main.py']", "1", "/dev/pts/0 ['0', 'ptmx']"]
    assert second == ["[1, 2]", "['b'] ['b.txt', 'main.py']", "1", "/dev/pts/0 ['0', 'ptmx']"]


async def test_a_run_cannot_make_user_namespaces_or_keep_capabilities(warm_sandbox: Sandbox) -> None:
    script = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "status = open('/proc/self/status').read().splitlines()\n"
        "print([line.split()[1] for line in status if line.startswith(('CapEff', 'CapPrm', 'CapBnd'))])\n"
        "print(os.getuid())\n"
    )
    result = await run(warm_sandbox, script)
    unshare, capabilities, identity = lines(result)
    assert unshare.split()[0] == "-1"
    assert capabilities == str(["0000000000000000"] * 3)
    assert identity == "65534"


async def test_the_traceback_and_exit_status_are_the_programs(warm_sandbox: Sandbox) -> None:
    failed = await warm_sandbox.run(
        {"main.py": "def f():\n    raise ValueError('boom')\nf()\n"}, [*ARGS, "main.py"], limits=RUN_LIMITS
    )
    assert failed.exit_code == 1
    assert failed.stderr.data.decode() == (
        "Traceback (most recent call last):\n"
        '  File "/workspace/main.py", line 3, in <module>\n    f()\n'
        "  File \"/workspace/main.py\", line 2, in f\n    raise ValueError('boom')\n"
        "ValueError: boom\n"
    )
    exited = await warm_sandbox.run(
        {
            "main.py": "import sys, atexit\natexit.register(print, 'bye')\nf = open('kept.txt', 'w')\n"
            "f.write('unflushed')\nsys.exit(3)\n"
        },
        [*ARGS, "main.py"],
        limits=RUN_LIMITS,
        collect=True,
    )
    assert exited.exit_code == 3
    assert exited.stdout.data == b"bye\n"
    assert (exited.files or {})[
        "kept.txt"
    ] == b"unflushed"  # a file left open is flushed at exit, as by python
    code = await warm_sandbox.run({}, ["-I", "-c", "import sys; print(sys.argv)", "x"], limits=Limits())
    assert code.stdout.data == b"['-c', 'x']\n"


async def slow_call_in_flight(code: Any) -> tuple[WarmRunner, str, asyncio.Future[Any]]:
    """A rollout's `run_python` of a 5-second script over HTTP, its run started: the warm runner, the
    rollout's trace and the call's answer to come."""
    resources = served_resources(code.http)["code"]
    assert isinstance(resources, CodeResources) and resources.warm is not None
    runner = resources.warm
    trace = new_trace()
    await code.write(trace, "slow.py", "import time\ntime.sleep(5)\n", task_id=TASK)
    body = {"call_id": "slow", "trace_id": trace, "item": {"task_id": TASK}, "arguments": {"path": "slow.py"}}
    call = asyncio.ensure_future(code.http.post("/tools/run_python", json=body))
    for _ in range(500):  # until the run is in flight (bounded)
        if runner.current is not None and runner.current.inflight:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert runner.current is not None
    return runner, trace, call


async def test_a_killed_parent_is_a_503_with_retry_after_and_the_next_call_works(code_app: Any) -> None:
    async with code_app() as code:
        runner, trace, call = await slow_call_in_flight(code)
        assert runner.current is not None
        os.killpg(runner.current.process.pid, signal.SIGKILL)  # bwrap and the parent inside it
        answer = await asyncio.wait_for(call, 30)
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"]
        assert "parent stopped" in answer.text
        again = await code.run(trace, "solution.py", task_id=TASK)
        health = (await code.http.get("/healthz")).json()["packs"]["code"]
    assert again["exit_code"] == 0
    assert health["path"] == "warm" and health["parents_started"] == 2


def run_inits(group: Path) -> list[int]:
    """The host pids of the processes of `group` that are pid 1 of their namespace: a run's init."""
    inits = []
    for pid in (group / "cgroup.procs").read_text().split():
        status = Path(f"/proc/{pid}/status").read_text()
        (nspid,) = [line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")]
        if nspid[-1] == "1":
            inits.append(int(pid))
    return inits


async def test_a_runs_init_killed_midway_is_a_503_and_the_next_call_works(code_app: Any) -> None:
    """The run's init is harness code its program cannot signal: its end without a report is the sandbox's
    failure (an outage the trainer retries), never an answer blaming the program."""
    async with code_app() as code:
        runner, trace, call = await slow_call_in_flight(code)
        parent = runner.current
        assert parent is not None
        (busy,) = [slot for slot in parent.slots if slot not in parent.free]
        inits = run_inits(busy.group)
        assert len(inits) == 1, inits
        os.kill(inits[0], signal.SIGKILL)
        answer = await asyncio.wait_for(call, 30)
        again = await code.run(trace, "solution.py", task_id=TASK)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"]
    assert "ended before its report" in answer.text
    assert again["exit_code"] == 0


async def test_the_parent_is_replaced_after_its_runs(code_app: Any) -> None:
    async with code_app({"warm_runs": 2}) as code:
        runner = served_resources(code.http)["code"].warm  # type: ignore[attr-defined]
        trace = new_trace()
        for _ in range(5):
            assert (await code.run(trace, "solution.py", task_id=TASK))["exit_code"] == 0
        health = (await code.http.get("/healthz")).json()["packs"]["code"]
    # The probe and runs 1-5, two per parent: (probe, 1), (2, 3), (4, 5).
    assert runner.started == 3
    assert health["parents_started"] == 3 and health["warm_runs"] == 6 and health["warm_runs_per_parent"] == 2


async def test_healthz_says_which_path_is_active(code_app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    async with code_app() as code:
        warm_health = (await code.http.get("/healthz")).json()
    async with code_app({"warm": False}) as code:
        forced = (await code.http.get("/healthz")).json()
        assert (await code.run(new_trace(), "solution.py", task_id=TASK))["exit_code"] == 0
    # A parent that cannot start (as where bwrap's sandbox may not make user namespaces): the cold path.
    monkeypatch.setattr(warm, "WARM_FLAGS", ("-I", "--no-such-flag"))
    async with code_app() as code:
        fallen = (await code.http.get("/healthz")).json()
        ran = await code.run(new_trace(), "solution.py", task_id=TASK)
    assert warm_health["status"] == "ok"
    assert warm_health["packs"]["code"]["path"] == "warm"
    assert warm_health["packs"]["code"]["parent_rss_bytes"] > 0
    assert {key: value for key, value in forced["packs"]["code"].items() if key != "interpreters"} == {
        "sandbox": "bwrap",
        "path": "cold",
        "why_cold": "SPARRING_CODE_WARM=false",
    }
    assert forced["packs"]["code"]["interpreters"]["live"] == 0
    assert fallen["packs"]["code"]["path"] == "cold"
    assert "the warm parent cannot run here" in fallen["packs"]["code"]["why_cold"]
    assert ran["exit_code"] == 0


async def test_the_precompiled_harness_is_the_parents_and_a_run_cannot_change_it(
    warm_sandbox: Sandbox,
) -> None:
    """The grading harness and its runner run from code objects the parent compiled once; a run that
    replaces or empties them changes only its own copy, and the next grade still passes (and still fails
    a wrong solution)."""
    sources = [check._source(name) for name in warm.PRECOMPILED]
    script = (
        "import sys, types\n"
        "code = sys.modules['sparring_precompiled'].code\n"
        "print(sorted(len(s) for s in code), all(isinstance(c, types.CodeType) for c in code.values()))\n"
        "evil = compile('print(\"tampered\")', '<string>', 'exec')\n"
        "for source in list(code): code[source] = evil\n"
    )
    first = await run(warm_sandbox, script)
    assert lines(first) == [f"{sorted(len(s) for s in sources)} True"]
    task = all_tasks()[TASK]
    passed, result = await check.run_hidden_tests(
        warm_sandbox, task, {**task.starting_files(), "solution.py": task.gold_solution}
    )
    assert passed, result.stderr.data.decode()
    assert b"tampered" not in result.stdout.data
    failed, _ = await check.run_hidden_tests(
        warm_sandbox,
        task,
        {**task.starting_files(), "solution.py": "def has_close_elements(n, t):\n    return True\n"},
    )
    assert not failed
    second = await run(warm_sandbox, script)  # a later run finds the parent's, not the earlier run's
    assert lines(second) == lines(first)


async def test_a_runs_threads_and_forks_work_as_in_a_fresh_interpreter(warm_sandbox: Sandbox) -> None:
    """The run's process is forked without Python's fork hooks: threads, locks, a pool, a fork of its
    own, and a non-daemon thread still running when the script ends all behave as under `python`."""
    result = await run(
        warm_sandbox,
        "import os, sys, threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "print(threading.current_thread() is threading.main_thread(), threading.active_count())\n"
        "lock = threading.Lock(); counts = []\n"
        "def work(i):\n"
        "    with lock:\n"
        "        counts.append(i)\n"
        "    return i * i\n"
        "with ThreadPoolExecutor(4) as pool:\n"
        "    print(sum(pool.map(work, range(10))), len(counts))\n"
        "sys.stdout.flush()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    t = threading.Thread(target=lambda: print('child thread', flush=True)); t.start(); t.join()\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "def late():\n"
        "    time.sleep(0.2)\n"
        "    print('late thread done', flush=True)\n"
        "threading.Thread(target=late).start()\n"
        "print('main done', flush=True)\n",
    )
    assert lines(result) == ["True 1", "285 10", "child thread", "main done", "late thread done"]


async def test_a_program_that_takes_its_status_descriptor_keeps_its_files_and_status(
    warm_sandbox: Sandbox,
) -> None:
    """A run's last act tells its init its exit status on a descriptor of its own, so the report need not
    wait for the kernel to take the process apart. A program that closed that descriptor and opened its
    own files in its place gets them back as it wrote them, and its exit status is its own."""
    result = await warm_sandbox.run(
        {
            "main.py": "import os\n"
            "os.closerange(3, 1 << 16)\n"
            "fds = [os.open(f'f{i}.txt', os.O_CREAT | os.O_WRONLY, 0o644) for i in range(30)]\n"
            "for fd in fds:\n"
            "    os.write(fd, b'x')\n"
            "print('wrote', len(fds))\n"
            "raise SystemExit(3)\n"
        },
        [*ARGS, "main.py"],
        limits=RUN_LIMITS,
        collect=True,
    )
    assert (result.exit_code, lines(result)) == (3, ["wrote 30"]), result
    files = result.files or {}
    assert {name: files[name] for name in files if name != "main.py"} == {
        f"f{i}.txt": b"x" for i in range(30)
    }, files


async def test_a_forked_child_that_ends_like_the_program_does_not_end_the_run(warm_sandbox: Sandbox) -> None:
    """A process the program forks runs the rest of the script as `python` would, and may leave by
    `sys.exit` as the program does: only the program's own end is told to its init, so the run ends with
    the program, not with its child."""
    result = await run(
        warm_sandbox,
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(5)\n"
        "time.sleep(0.3)\n"
        "print('child ended', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "open('after.txt', 'w').write('parent')\n",
    )
    assert lines(result) == ["child ended 5"], result
    assert (result.files or {}).get("after.txt") == b"parent", result


async def test_a_program_that_says_a_status_early_ends_with_it_and_leaves_nothing(
    one_slot_sandbox: Sandbox,
) -> None:
    """A program may write an exit status on every pipe it holds (the init's among them) and carry on:
    that ends its run with that status, as `os._exit` would; the run's processes are killed, and the next
    run of the slot starts only once they are gone."""
    assert one_slot_sandbox.warm is not None
    result = await one_slot_sandbox.run(
        {
            "main.py": "import os, stat, struct, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('started', flush=True)\n"
            "for fd in range(3, 1024):\n"
            "    try:\n"
            "        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
            "            os.write(fd, struct.pack('>i', 7))\n"
            "    except OSError:\n"
            "        pass\n"
            "for i in range(600):\n"
            "    open(f'later{i}.txt', 'w').write('x')\n"
            "    time.sleep(0.1)\n"
        },
        [*ARGS, "main.py"],
        limits=RUN_LIMITS,
        collect=True,
    )
    assert (result.exit_code, result.timed_out, lines(result)) == (7, False, ["started"]), result
    assert result.wall_seconds < RUN_LIMITS.wall_seconds, result
    assert one_slot_sandbox.warm.current is not None and len(one_slot_sandbox.warm.current.slots) == 1
    after = await run(
        one_slot_sandbox, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    assert lines(after) == ["[1, 2]"], after


async def test_a_slots_next_run_has_the_whole_memory_cap(tmp_path: Path) -> None:
    """Runs of one slot one right after another, each holding most of the memory cap in processes it
    leaves running and files it leaves behind: none of it outlives the run (its report is sent while its
    processes are still being killed; the slot starts its next run only once they are gone), so no run is
    charged for the memory of the one before it."""
    sandbox = build_sandbox(CodeSettings(run_memory_bytes=256 << 20), home=tmp_path, binds_loopback=True)
    if not sandbox.memory.per_run:
        sandbox.close()
        pytest.skip("this machine gives a run no memory cgroup of its own")
    async with started_warm(sandbox, spare_slots=0) as runner:
        # Each run holds 48 MiB in files of its workspace (not kept: over the limit), 4 x 40 MiB in
        # children it leaves running, and 10 MiB itself: 218 MiB of the 256 MiB cap.
        hold = (
            "import subprocess, sys\n"
            "for i in range(48):\n"
            "    open(f'/workspace/big{i}.bin', 'wb').write(b'\\x01' * (1 << 20))\n"
            "child = 'import time; block = bytearray(b\"\\\\x01\") * (40 << 20); print(1, flush=True); '\n"
            "child += 'time.sleep(600)'\n"
            "children = [subprocess.Popen([sys.executable, '-c', child], stdin=subprocess.PIPE, "
            "stdout=subprocess.PIPE) for _ in range(4)]\n"
            "held = sum(len(c.stdout.readline()) for c in children)\n"
            "block = bytearray(b'\\x01') * (10 << 20)\n"
            "print(held)\n"
        )
        for _ in range(8):
            result = await sandbox.run({"main.py": hold}, [*ARGS, "main.py"], limits=RUN_LIMITS, collect=True)
            assert (result.exit_code, lines(result), result.memory_exceeded) == (0, ["8"], False), result
        assert runner.current is not None and len(runner.current.slots) == 1


def _private_kib(result: RunResult) -> int:
    """The run's own Private_Dirty (smaps_rollup), in KiB: the parent's pages it copied, and its own."""
    for line in lines(result):
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1])
    raise AssertionError(f"no Private_Dirty in {lines(result)}")


async def test_an_idle_workers_next_run_copies_its_pages_before_its_job(
    one_slot_sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run prepared while no other run of the worker is in flight copies the parent's pages while it
    waits (no page faults after its job arrives), prepared a moment after the last run was given back;
    a run that comes before then prepares its slot itself, and under concurrent runs the next ones are
    prepared at once, both without the copy (it would take CPU from the runs in flight)."""
    asked: list[bool] = []
    copying = {"allowed": False}
    prepare = warm.Slot.prepare

    def recorded(self: warm.Slot, prefault: bool = False) -> None:
        asked.append(prefault)
        prepare(self, prefault and copying["allowed"])

    monkeypatch.setattr(warm.Slot, "prepare", recorded)
    script = "print(open('/proc/self/smaps_rollup').read())\n"

    async def idle_run() -> int:
        await asyncio.sleep(1.0)  # the copy, if any, is done before the job
        return _private_kib(await run(one_slot_sandbox, script))

    await run(one_slot_sandbox, "pass\n")  # its slot is made (and its first run prepared) for it
    without = await idle_run()
    copying["allowed"] = True
    copied = await idle_run()
    assert asked == [False, True, True], asked  # the new slot's, then one per give-back to an idle worker
    assert copied >= without + 4096, (without, copied)
    # A run right after another (a slot whose preparation is still to come) prepares it, without the copy.
    monkeypatch.setattr(warm, "PREPARE_AFTER_SECONDS", 0.5)
    await asyncio.sleep(0.1)
    asked.clear()
    await run(one_slot_sandbox, "pass\n")
    await run(one_slot_sandbox, "pass\n")
    await asyncio.sleep(1.0)
    assert asked == [False, True], asked
    # Several at once: the slots given back while others still run are prepared without the copy.
    monkeypatch.setattr(warm, "PREPARE_AFTER_SECONDS", 0.005)
    asked.clear()
    await asyncio.gather(*(run(one_slot_sandbox, "import time\ntime.sleep(0.3)\n") for _ in range(3)))
    await asyncio.sleep(0.2)
    assert False in asked and asked[-1] is True, asked


def test_a_slot_closed_from_two_threads_at_once_closes_its_descriptor_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed run's slot is dropped in a worker thread while its retiring parent closes every slot on
    the event loop: a descriptor closed twice would close whatever took its number in between."""
    ours, theirs = socket.socketpair()
    slot = warm.Slot(ours, None)
    slot.events = os.open(os.devnull, os.O_RDONLY)
    events, closed, real_close = slot.events, [], os.close

    def slow_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)
        time.sleep(0.05)  # the other thread runs meanwhile

    monkeypatch.setattr(os, "close", slow_close)  # the module the slot closes it with
    threads = [threading.Thread(target=slot.close) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    theirs.close()
    assert closed.count(events) == 1 and ours.fileno() == -1


async def test_an_interrupt_sent_to_the_runs_init_never_stops_its_supervision(warm_sandbox: Sandbox) -> None:
    """The run's pid 1 is its init: a signal the run sends it changes nothing (Python's SIGINT handler
    would have raised KeyboardInterrupt there and ended the run's report)."""
    result = await run(
        warm_sandbox,
        "import os, signal, time\n"
        "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):\n"
        "    os.kill(1, sig)\n"
        "time.sleep(0.2)\n"
        "open('kept.txt', 'w').write('yes')\n"
        "print('alive')\n",
    )
    assert (result.exit_code, lines(result)) == (0, ["alive"])
    assert result.files is not None and result.files.get("kept.txt") == b"yes"


async def test_a_runs_file_systems_hold_a_bounded_number_of_inodes(warm_sandbox: Sandbox) -> None:
    """Empty files cost no size but kernel memory: each of the run's tmpfs caps its inodes."""
    result = await run(
        warm_sandbox,
        "import errno, os\n"
        "made = 0\n"
        "try:\n"
        "    for i in range(40_000):\n"
        "        os.close(os.open(f'/tmp/e{i}', os.O_CREAT | os.O_WRONLY))\n"
        "        made += 1\n"
        "except OSError as error:\n"
        "    print(errno.errorcode[error.errno])\n"
        "print(made)\n",
    )
    said = lines(result)
    assert said[0] == "ENOSPC" and int(said[1]) < 40_000, said


async def test_a_run_cancelled_midway_leaves_the_next_runs_working(warm_sandbox: Sandbox) -> None:
    """A call cancelled while its run is in flight (its deadline) ends every task reading the run's socket
    and pipes before they are closed: the next runs, whose descriptors may reuse those numbers, are read."""
    for _ in range(3):
        task = asyncio.ensure_future(run(warm_sandbox, "import time\ntime.sleep(3)\n"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3):
            result = await asyncio.wait_for(run(warm_sandbox, "print('next')\n"), 10)
            assert lines(result) == ["next"]


async def test_a_slot_that_ended_while_free_is_replaced_not_an_error(one_slot_sandbox: Sandbox) -> None:
    """A free slot whose process ended (its cgroup's memory cap killed it, say) is dropped when a run
    takes it, and the run goes to a new slot: never a 503 for the slot's end."""
    runner = one_slot_sandbox.warm
    assert runner is not None
    await run(one_slot_sandbox, "pass\n")
    assert runner.current is not None and len(runner.current.free) == 1
    ended = runner.current.free[0]
    assert ended.ready is None  # given back moments ago: its next run is not prepared yet
    ended.sock.shutdown(socket.SHUT_WR)  # the slot reads the end of its socket and exits
    await asyncio.sleep(0.001)
    result = await run(one_slot_sandbox, "print('taken')\n")
    assert lines(result) == ["taken"]
    assert ended not in runner.current.slots


async def test_a_call_cancelled_while_the_parent_starts_leaves_no_parent_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[warm.Parent] = []

    class Recorded(warm.Parent):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            started.append(self)

    async def never(sock: socket.socket, size: int) -> bytes:
        await asyncio.sleep(3600)
        return b""

    monkeypatch.setattr(warm, "Parent", Recorded)
    monkeypatch.setattr(warm, "_receive", never)  # the parent's hello never comes
    sandbox = build_sandbox(CodeSettings(), home=tmp_path, binds_loopback=True)
    runner = WarmRunner(sandbox, max_runs=500)
    try:
        task = asyncio.ensure_future(runner.start())
        for _ in range(200):
            if started:
                break
            await asyncio.sleep(0.05)
        assert started, "the parent was never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(started[0].process.wait(), 10)  # stopped, not left waiting on its control
    finally:
        await runner.close()
        sandbox.close()


BIND = (
    "import socket, sys\n"
    "family, host = (socket.AF_INET6, '::1') if sys.argv[1] == '6' else (socket.AF_INET, '127.0.0.1')\n"
    "server = socket.socket(family)\n"
    "try:\n"
    "    server.bind((host, 47123))  # no SO_REUSEADDR: a socket left on the port makes it fail\n"
    "except OSError as error:\n"
    "    if error.errno == 99:  # no ::1 here\n"
    "        print('no address')\n"
    "        sys.exit(0)\n"
    "    raise\n"
    "server.listen(1)\n"
    "client = socket.create_connection((host, 47123))\n"
    "accepted, _ = server.accept()\n"
    "accepted.close()  # closed first on the server's side: that side waits in TIME_WAIT\n"
    "client.close()\n"
    "server.close()\n"
    "print('bound')\n"
)


@pytest.mark.parametrize("version", ["4", "6"])
async def test_a_runs_closed_connections_never_keep_the_next_run_from_its_port(
    one_slot_sandbox: Sandbox, version: str
) -> None:
    """Runs of one slot share its network namespace: a connection a run closed waits in TIME_WAIT there
    for a minute, which would refuse the next run a bind to that port. The slot moves to a fresh network
    namespace before a run when the last one left any TCP socket behind."""
    for _ in range(3):
        result = await one_slot_sandbox.run({"main.py": BIND}, [*ARGS, "main.py", version], limits=RUN_LIMITS)
        if lines(result) == ["no address"]:
            pytest.skip("the sandbox's loopback has no ::1 here")
        assert (result.exit_code, lines(result)) == (0, ["bound"]), result.stderr.data.decode()
    assert one_slot_sandbox.warm is not None and one_slot_sandbox.warm.current is not None
    assert len(one_slot_sandbox.warm.current.slots) == 1  # one slot took every run


LEAVE_ON_THE_NETWORK = """\
import socket
sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(25):
    sender.sendto(b"", ("127.0.0.1", 9))
# A listening abstract socket kept alive past the run by a cycle of descriptors in flight.
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\\0left-by-a-run")
server.listen(1)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
socket.send_fds(a, [b"x"], [server.fileno(), a.fileno(), b.fileno()])
"""
NO_ROUTE = """\
import socket
sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(7):  # no route: no packet, no socket left; only the namespace's counters know
    try:
        sender.sendto(b"", ("10.1.2.3", 9))
    except OSError:
        pass
"""
FIND_ON_THE_NETWORK = """\
import socket
for line in open("/proc/net/dev"):
    if line.strip().startswith("lo:"):
        print(line.split()[2])
names, values = [line.split() for line in open("/proc/net/snmp") if line.startswith("Ip:")]
print(dict(zip(names, values))["OutNoRoutes"])
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    client.connect("\\0left-by-a-run")
    print("found")
except OSError:
    print("not found")
"""


async def test_nothing_a_run_did_on_the_network_reaches_the_next_run(one_slot_sandbox: Sandbox) -> None:
    """Runs of one slot take turns in its network namespace: after a run that used it (packets on the
    loopback, a unix socket that outlives it), the next run starts in a fresh one, its loopback's
    counters at zero and the name free."""
    await run(one_slot_sandbox, LEAVE_ON_THE_NETWORK)
    after = await run(one_slot_sandbox, FIND_ON_THE_NETWORK)
    await run(one_slot_sandbox, NO_ROUTE)
    after_no_route = await run(one_slot_sandbox, FIND_ON_THE_NETWORK)
    assert lines(after) == ["0", "0", "not found"]
    assert lines(after_no_route) == ["0", "0", "not found"]
    assert one_slot_sandbox.warm is not None and one_slot_sandbox.warm.current is not None
    assert len(one_slot_sandbox.warm.current.slots) == 1  # the same slot took both runs


async def test_a_run_right_after_another_takes_a_prepared_slot(warm_sandbox: Sandbox) -> None:
    """An idle worker keeps a spare slot with its next run prepared: a run that comes right after another
    (no pause for the slot just given back to prepare) takes a prepared slot and never waits for its own
    slot's preparation."""
    runner = warm_sandbox.warm
    assert runner is not None and runner.spare_slots == 1
    await run(warm_sandbox, "pass\n")
    parent = runner.current
    assert parent is not None
    for _ in range(200):  # the spare is made and every free slot prepared (5 ms after the run)
        if len(parent.free) == 2 and all(slot.ready is not None for slot in parent.free):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"{len(parent.free)} free slots, not a prepared spare beside the used one")
    taken: list[bool] = []
    take = runner._take

    async def recorded() -> tuple[warm.Parent, warm.Slot]:
        prepared = {id(slot) for slot in parent.free if slot.ready is not None}
        chosen = await take()
        taken.append(id(chosen[1]) in prepared)
        return chosen

    runner._take = recorded  # type: ignore[method-assign]
    for _ in range(2):  # one right after the other: the second finds the slot just used unprepared
        assert lines(await run(warm_sandbox, "print('next')\n")) == ["next"]
    assert taken == [True, True]
    assert len(parent.slots) == 2  # the spare only: no slot more


async def test_runs_cancelled_at_every_step_leak_no_descriptor_and_close_none_twice(
    warm_sandbox: Sandbox,
) -> None:
    """A call cancelled at any point of its run (its deadline) leaves the server with the descriptors it
    had: each of the run's pipes is closed once, by whatever took it (a descriptor closed twice would close
    whatever took its number in between; one never closed is a leak per cancelled call)."""
    await run(warm_sandbox, "pass\n")
    await asyncio.sleep(0.1)  # the spare slot and the next runs' preparations made

    def descriptors() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before = descriptors()
    for step in range(40):  # cut 0 to 10 ms in: before the job, while the run starts, runs and reports
        task = asyncio.ensure_future(run(warm_sandbox, "print('cut')\n"))
        await asyncio.sleep(step * 0.00025)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        result = await asyncio.wait_for(run(warm_sandbox, "print('next')\n"), 10)
        assert lines(result) == ["next"]
    await asyncio.sleep(0.1)  # the slots given back prepare their next runs (a socket each)
    leaked = descriptors() - before
    assert len(leaked) <= 2, [named(fd) for fd in leaked]


def named(fd: str) -> str:
    """What the server's descriptor `fd` is (gone: the listing's own)."""
    try:
        return f"{fd}: {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return f"{fd}: gone"
