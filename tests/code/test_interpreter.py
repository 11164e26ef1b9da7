"""The `python` tool: a persistent sandboxed interpreter per rollout, through the HTTP API.

State persists within one trace_id and never crosses to another; exceptions, crashes, timeouts and
hostile output are answers (never a 5xx); idle and least-recently-used interpreters are stopped and the
next call says so; calls of one rollout run one at a time; a retried call_id replays; a call that lands
on a worker without the rollout's interpreter says the state is lost instead of running on wrong state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import platform
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.code.conftest import CodeClient, served_resources
from tests.code.test_isolation import processes_with
from tests.conftest import new_trace
from tests.grading.test_state_lost import forget_state
from tools.code import freezer, harness_interpreter
from tools.code.interpreter import RESTARTED, Interpreter, InterpreterPool
from tools.code.runtime import CodeResources
from tools.code.workspace import LIMITS

pytestmark = pytest.mark.parametrize("backend", ["real"])  # the shared lock, ledger and state of a fleet

TASK = "HumanEval/0"
FAST = {"interpreter_cell_seconds": 3.0}


async def cell(code: CodeClient, trace: str, source: str, *, call_id: str | None = None) -> Any:
    """The `python` tool's answer: a dict, or the `Error: ...` text."""
    output = await code.call(trace, "python", {"code": source}, task_id=TASK, call_id=call_id)
    return output if output.startswith("Error:") else json.loads(output)


def pool_of(code: CodeClient) -> InterpreterPool:
    resources = served_resources(code.http)["code"]
    assert isinstance(resources, CodeResources) and resources.interpreters is not None
    return resources.interpreters


async def test_variables_imports_and_files_persist_between_calls(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        first = await cell(code, trace, "import math\nx = 20\nopen('notes.txt', 'w').write('kept')\nx + 1")
        second = await cell(code, trace, "print(math.pi > 3, x)\nopen('notes.txt').read()")
        read = await code.call(trace, "read_file", {"path": "notes.txt"}, task_id=TASK)
        await code.write(trace, "helper.py", "def twice(n):\n    return 2 * n\n", task_id=TASK)
        third = await cell(code, trace, "from helper import twice\ntwice(x)")
        solution = await cell(code, trace, "'def ' in open('solution.py').read()")
    assert first == {"stdout": "", "stderr": "", "value": "21"}
    assert second == {"stdout": "True 20\n", "stderr": "", "value": "'kept'"}
    assert read == "kept"  # a file the interpreter wrote is in the rollout's workspace
    assert third["value"] == "40"  # a file another tool wrote is in the interpreter's
    assert solution["value"] == "True"  # the task's starting files are there from the start


async def test_two_rollouts_never_see_each_others_state(code_app: Any, backend: str) -> None:
    secret = uuid.uuid4().hex
    async with code_app(code=FAST) as code:
        owner, other = new_trace(), new_trace()
        await cell(code, owner, f"secret = {secret!r}\nopen('secret.txt', 'w').write(secret)")
        looked = await cell(
            code,
            other,
            "import os\nprint(sorted(os.listdir('.')))\n'secret' in globals() or 'secret' in dir()",
        )
        mine = await cell(code, owner, "secret")
    assert looked["value"] == "False"
    assert "secret.txt" not in looked["stdout"] and secret not in json.dumps(looked)
    assert mine["value"] == repr(secret)


async def test_a_process_a_cell_left_running_never_writes_into_a_later_cells_output(
    code_app: Any, backend: str
) -> None:
    """A cell's output is its own: a process an earlier cell started, writing later to every descriptor
    it holds, reaches none of the next cells' output."""
    late = (
        "import os, time\n"
        "time.sleep(0.4)\n"
        "for name in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        os.write(int(name), b'LATE')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        started = await cell(
            code, trace, f"import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', {late!r}])"
        )
        answers = []
        for _ in range(4):  # before, while and after it writes
            answers.append(await cell(code, trace, "print('mine')"))
            await asyncio.sleep(0.2)
        ended = await cell(code, trace, "child.wait(5)")
    assert started == {"stdout": "", "stderr": ""}, started
    assert answers == [{"stdout": "mine\n", "stderr": ""}] * 4, answers
    assert ended["value"] == "0", ended


async def test_a_cell_answers_the_value_of_its_last_expression_only(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        expression = await cell(code, trace, "y = [1, 2]\ny + [3]")
        statement = await cell(code, trace, "z = len(y)")
        none = await cell(code, trace, "print('side effect')")
        underscore = await cell(code, trace, "_")
    assert expression["value"] == "[1, 2, 3]"
    assert "value" not in statement and "value" not in none
    assert none["stdout"] == "side effect\n"
    assert underscore["value"] == "[1, 2, 3]"  # the last value, as in a notebook


async def test_exceptions_are_answers_and_the_interpreter_survives(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "kept = 7")
        raised = await cell(code, trace, "def f():\n    return 1 / 0\nf()")
        syntax = await cell(code, trace, "def broken(:\n")
        exited = await cell(code, trace, "import sys\nsys.exit(3)")
        after = await cell(code, trace, "kept")
    assert "ZeroDivisionError" in raised["exception"] and "<cell 2>" in raised["exception"]
    assert "return 1 / 0" in raised["exception"]  # the cell's source line, as a notebook shows it
    assert "harness_interpreter" not in raised["exception"]  # the driver's frames are not shown
    assert "SyntaxError" in syntax["exception"]
    assert "SystemExit: 3" in exited["exception"]
    assert after["value"] == "7"


async def test_an_exit_kills_the_interpreter_and_the_next_call_says_state_is_lost(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        crashed = await cell(code, trace, "import os\nos._exit(5)")
        restarted = await cell(code, trace, "x")
        fresh = await cell(code, trace, "'x' in globals()")
    assert crashed.startswith(
        "Error: the interpreter stopped while running this code (it exited with status 5)"
    )
    assert restarted.startswith(f"Error: {RESTARTED}")
    assert fresh["value"] == "False"


async def test_a_cell_that_runs_too_long_stops_the_interpreter(code_app: Any, backend: str) -> None:
    marker = f"sparring-leftover-{uuid.uuid4().hex}"
    loop = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}])\n"
        "while True:\n    pass"
    )
    async with code_app(code={"interpreter_cell_seconds": 1.0}) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        looped = await cell(code, trace, loop)
        left = processes_with(marker)
        restarted = await cell(code, trace, "x")
        fresh = await cell(code, trace, "1 + 1")
    assert left == []  # the interpreter and all it started are gone
    assert looped.startswith("Error: the code ran longer than 1 seconds")
    assert restarted.startswith(f"Error: {RESTARTED}") and "stopped it" in restarted
    assert fresh["value"] == "2"


async def test_a_memory_blowup_is_held_by_the_cap(code_app: Any, backend: str) -> None:
    MiB = 1024 * 1024
    async with code_app(code={**FAST, "run_memory_bytes": 64 * MiB}) as code:
        trace = new_trace()
        per_run = served_resources(code.http)["code"].sandbox.memory.per_run  # type: ignore[attr-defined]
        await cell(code, trace, "x = 1")
        blown = await cell(code, trace, f"hog = bytearray({256 * MiB})")
        after = await cell(code, trace, "x")
    if per_run:  # a cgroup: the kernel kills the interpreter
        assert blown.startswith("Error: the interpreter stopped") and "more memory than its limit" in blown
        assert after.startswith(f"Error: {RESTARTED}")
    else:  # an address-space limit: the allocation fails inside
        assert "MemoryError" in blown["exception"]
        assert after["value"] == "1"


async def test_an_idle_interpreter_is_stopped_and_the_next_call_says_so(code_app: Any, backend: str) -> None:
    async with code_app(code={**FAST, "interpreter_idle_seconds": 60.0}) as code:
        pool = pool_of(code)
        now = [0.0]
        pool.clock = lambda: now[0]
        trace, busy = new_trace(), new_trace()
        await cell(code, trace, "x = 1")
        now[0] = 50.0
        await cell(code, busy, "y = 2")
        now[0] = 100.0  # `trace` idle for 100 s, `busy` for 50 s
        await pool.reap()
        restarted = await cell(code, trace, "x")
        kept = await cell(code, busy, "y")
    assert restarted.startswith(f"Error: {RESTARTED}") and "idle for more than 60 seconds" in restarted
    assert kept["value"] == "2"


async def test_at_the_cap_the_least_recently_used_interpreter_is_stopped(code_app: Any, backend: str) -> None:
    async with code_app(code={**FAST, "interpreter_max": 2}) as code:
        first, second, third = new_trace(), new_trace(), new_trace()
        await cell(code, first, "v = 'first'")
        await cell(code, second, "v = 'second'")
        await cell(code, first, "v")  # `second` is now the least recently used
        await cell(code, third, "v = 'third'")
        live = len(pool_of(code).live)
        kept = await cell(code, first, "v")
        evicted = await cell(code, second, "v")
    assert live == 2
    assert kept["value"] == "'first'"
    assert evicted.startswith(f"Error: {RESTARTED}") and "least recently used" in evicted


async def test_parallel_calls_of_one_rollout_run_one_at_a_time(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "events = []")
        step = "import time\nevents.append(('start', {n}))\ntime.sleep(0.05)\nevents.append(('end', {n}))"
        answers = await asyncio.gather(*(cell(code, trace, step.format(n=n)) for n in range(4)))
        events = await cell(code, trace, "events")
    assert all(answer == {"stdout": "", "stderr": ""} for answer in answers), answers
    pairs = eval(events["value"])  # a list of tuples the test itself built
    assert len(pairs) == 8
    for start, end in zip(pairs[::2], pairs[1::2], strict=True):
        assert start[0] == "start" and end == ("end", start[1])  # never interleaved


async def test_a_retried_call_id_replays_without_running_again(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "count = 0")
        first = await cell(code, trace, "count += 1\ncount", call_id="retried")
        retried = await cell(code, trace, "count += 1\ncount", call_id="retried")
        now = await cell(code, trace, "count")
    assert first == retried == {"stdout": "", "stderr": "", "value": "1"}
    assert now["value"] == "1"


async def test_the_interpreter_has_no_network_and_no_host_files(
    code_app: Any, backend: str, tmp_path: Path
) -> None:
    connections: list[str] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append("connected")
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text("host secret")
    probe = (
        "import os, socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    net = 'connected'\n"
        "except OSError as exc:\n"
        "    net = type(exc).__name__\n"
        f"(net, os.path.exists({str(host_file)!r}), os.path.exists('/etc/passwd'), os.getuid(), os.getcwd())"
    )
    async with server, code_app(code=FAST) as code:
        answer = await cell(code, new_trace(), probe)
    network, host_seen, passwd_seen, uid, cwd = eval(answer["value"])
    assert network != "connected" and connections == []
    assert host_seen is False and passwd_seen is False
    assert uid == 65534 and cwd == "/workspace"


async def test_hostile_output_is_cut_and_never_a_server_error(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        huge = await cell(code, trace, "print('x' * 3_000_000)")
        binary = await cell(code, trace, "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)\nNone")
        value = await cell(code, trace, "'y' * 1_000_000")
        fd_level = await cell(code, trace, "import os\nos.write(2, b'\\xff\\xfe raw')\n")
        still = await cell(code, trace, "1")
    assert len(huge["stdout"]) < 20_000 and "[output truncated:" in huge["stdout"]
    assert "\ufffd" in binary["stdout"]  # undecodable bytes shown replaced, the answer still JSON
    assert "[value truncated:" in value["value"] and len(value["value"]) < 20_000
    assert fd_level["stderr"].endswith(" raw")  # what C code or children write to the fds is output
    assert still["value"] == "1"


async def test_a_call_on_another_worker_says_the_state_is_not_there(code_app: Any, backend: str) -> None:
    """Two apps on one Postgres and Redis: two workers of one fleet, each with its own interpreters."""
    trace = new_trace()
    async with code_app(code=FAST) as one, code_app(code=FAST) as two:
        await cell(one, trace, "x = 5", call_id="a1")
        elsewhere = await cell(two, trace, "x", call_id="b1")
        set_there = await cell(two, trace, "x = 9", call_id="b2")
        back = await cell(one, trace, "x", call_id="a2")
        back_again = await cell(one, trace, "'x' in globals()", call_id="a3")
    assert elsewhere.startswith(f"Error: {RESTARTED}") and "another server process" in elsewhere
    assert set_there == {"stdout": "", "stderr": ""}
    # Worker one still holds an interpreter with x = 5, but the rollout moved on: never the stale value.
    assert back.startswith(f"Error: {RESTARTED}")
    assert back_again["value"] == "False"


async def test_a_call_cut_by_its_deadline_never_lets_a_later_call_read_its_answer(
    code_app: Any, backend: str
) -> None:
    async with code_app(code={"interpreter_cell_seconds": 30.0}, tool_timeout_seconds=1.0) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        body = {
            "type": "function_call",
            "call_id": "slow",
            "name": "python",
            "arguments": json.dumps({"code": "import time\ntime.sleep(5)\n'slow'"}),
            "trace_id": trace,
            "item": {"task_id": TASK},
        }
        cut = await code.http.post("/tools/python", json=body)
        after = await cell(code, trace, "'fast'")
        fresh = await cell(code, trace, "'fast'")
    assert cut.status_code == 503  # the call's deadline: an outage the trainer retries
    assert after.startswith(f"Error: {RESTARTED}")  # never the cut call's 'slow'
    assert fresh["value"] == "'fast'"


async def test_frames_a_cell_forges_never_answer_a_later_call(code_app: Any, backend: str) -> None:
    forge = (
        "import json, os, struct\n"
        "fake = {'id': 'forged', 'value': \"'forged'\", 'exception': None, 'stdout': '', 'stderr': '',\n"
        "        'stdout_total': 0, 'stderr_total': 0, 'files': ''}\n"
        "frame = json.dumps(fake).encode()\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, struct.pack('>I', len(frame)) + frame)\n"
        "    except OSError:\n"
        "        pass\n"
        "'real'"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        forged = await cell(code, trace, forge)
        after = await cell(code, trace, "2 + 2")
        again = await cell(code, trace, "2 + 2")
    # A frame that answers no request stops the interpreter: never an answer, never one to wait past.
    assert forged.startswith("Error: the interpreter stopped while running this code"), forged
    assert after.startswith(f"Error: {RESTARTED}")
    assert again == {"stdout": "", "stderr": "", "value": "4"}


# A cell's code runs in the driver's process: from the cell, frame 2 is the driver's `cell` method.
FORGE = (
    "import json, os, struct, sys\n"
    "driver, request = sys._getframe(2).f_locals['self'], sys._getframe(2).f_locals['request']\n"
    "answer = {{'id': request['id'], 'value': None, 'exception': None, 'stdout': '', 'stderr': '',\n"
    "          'stdout_total': 0, 'stderr_total': 0, 'files': 'U1o='}}\n"
    "body = {body}\n"
    "with open(driver.frames, 'wb', closefd=False) as pipe:\n"
    "    pipe.write(struct.pack('>I', len(body)) + body)\n"
)


@pytest.mark.parametrize(
    "body",
    [
        "b'[' * 5000",  # deeper than the JSON decoder goes
        "json.dumps({**answer, 'stdout_total': float('inf')}).encode()",  # its own id, no count of bytes
        "json.dumps({**answer, 'stderr_total': -1}).encode()",
        "b' ' * (8 << 20)",  # larger than any cell's answer under its limits
    ],
    ids=["deep", "infinite-total", "negative-total", "huge"],
)
async def test_a_frame_no_driver_writes_stops_the_interpreter_never_a_5xx(
    code_app: Any, backend: str, body: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        forged = await cell(code, trace, FORGE.format(body=body))
        after = await cell(code, trace, "x")
        fresh = await cell(code, trace, "2 + 2")
    assert isinstance(forged, str) and forged.startswith(
        "Error: the interpreter stopped while running this code"
    ), forged
    assert after.startswith(f"Error: {RESTARTED}")
    assert fresh["value"] == "4"


@pytest.mark.parametrize(
    "source",
    [
        "raise ValueError(chr(0xd800))",
        "class Odd:\n    def __repr__(self):\n        return 'odd ' + chr(0xdfff)\nOdd()",
        "raise ValueError('m' * 20_000_000)",
        "class Loud(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\nraise Loud()",
    ],
    ids=["surrogate-exception", "surrogate-repr", "huge-exception", "exception-that-cannot-say-itself"],
)
async def test_a_cell_whose_value_or_exception_no_encoder_writes_is_an_answer(
    code_app: Any, backend: str, source: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        answer = await cell(code, trace, source)
        after = await cell(code, trace, "x")
    assert isinstance(answer, dict), answer  # an answer, never a 500, and the interpreter lives on
    shown = answer.get("value") or answer.get("exception") or ""
    assert shown and len(shown) < 70_000, len(shown)
    assert after["value"] == "1"


async def test_an_interpreter_killed_between_calls_is_restarted_and_said_so(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        process = pool_of(code).live[trace].session.process
        process.kill()  # from outside, as an operator or the kernel might
        await process.wait()
        restarted = await cell(code, trace, "x")
        fresh = await cell(code, trace, "'x' in globals()")
    assert restarted.startswith(f"Error: {RESTARTED}") and "ended between calls" in restarted
    assert fresh["value"] == "False"


async def test_the_interpreter_works_without_isolation_too(code_app: Any, backend: str) -> None:
    async with code_app(code={**FAST, "sandbox": "unsafe-local"}) as code:
        trace = new_trace()
        await cell(code, trace, "x = 3\nopen('made.txt', 'w').write('here')")
        answer = await cell(code, trace, "import os\n(x, sorted(os.listdir('.')))")
        read = await code.call(trace, "read_file", {"path": "made.txt"}, task_id=TASK)
    assert eval(answer["value"]) == (3, ["examples.py", "made.txt", "solution.py"])
    assert read == "here"


async def spares_ready(pool: InterpreterPool, count: int) -> list[int]:
    """The pids of the pool's spares once `count` are started and ready (within 30 s)."""
    for _ in range(600):
        if len(pool.spares) >= count:
            return [spare.session.process.pid for spare in pool.spares]
        await asyncio.sleep(0.05)
    raise AssertionError(f"{len(pool.spares)} of {count} spare interpreters started")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_a_rollouts_first_call_takes_a_spare_and_another_is_started(
    code_app: Any, backend: str
) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 1}) as code:
        pool = pool_of(code)
        [spare] = await spares_ready(pool, 1)
        trace = new_trace()
        first = await cell(code, trace, "x = 41\nx + 1")
        taken = pool.live[trace].session.process.pid
        [next_spare] = await spares_ready(pool, 1)
        again = await cell(code, trace, "x")
        still = pool.live[trace].session.process.pid
        health = (await code.http.get("/healthz")).json()["packs"]["code"]["interpreters"]
        mechanism = pool_of(code).sandbox.freezer.mechanism
    assert first["value"] == "42" and again["value"] == "41"
    assert taken == spare  # the first call ran in the interpreter started ahead
    assert next_spare != spare and still == spare
    assert health["live"] == 1 and health["spares"] == 1
    assert health["stopped_between_calls"] == mechanism
    assert mechanism in ("memory-cgroup", "own-cgroup", "signals")


async def test_a_spare_carries_nothing_and_an_interpreter_never_becomes_a_spare(
    code_app: Any, backend: str
) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 2}) as code:
        pool = pool_of(code)
        await spares_ready(pool, 2)
        first, second = new_trace(), new_trace()
        await cell(
            code,
            first,
            "import os\nsecret = 7\nopen('mine.txt', 'w').write('first')\nos.environ['MINE'] = '1'",
        )
        used = pool.live[first].session.process.pid
        await cell(code, first, "raise SystemExit(0)")  # ends the first rollout's interpreter
        spares = await spares_ready(pool, 2)
        seen = await cell(
            code,
            second,
            "import os\n('secret' in globals(), os.path.exists('mine.txt'), 'MINE' in os.environ)",
        )
    assert used not in spares  # an interpreter a rollout used is stopped, never handed to another
    assert seen["value"] == "(False, False, False)"


async def test_a_spare_that_ended_while_waiting_is_passed_over(code_app: Any, backend: str) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 1}) as code:
        pool = pool_of(code)
        await spares_ready(pool, 1)
        dead = pool.spares[0].session.process
        dead.kill()  # from outside, as the kernel's OOM killer might
        await dead.wait()
        trace = new_trace()
        answer = await cell(code, trace, "1 + 1")
        used = pool.live[trace].session.process.pid
    assert answer == {"stdout": "", "stderr": "", "value": "2"}  # no word of a lost state: there was none
    assert used != dead.pid


async def test_without_spares_the_first_call_starts_its_interpreter(code_app: Any, backend: str) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 0}) as code:
        pool = pool_of(code)
        trace = new_trace()
        answer = await cell(code, trace, "2 * 21")
        await asyncio.sleep(0.3)
        assert not pool.spares and trace in pool.live
    assert answer["value"] == "42"


async def test_closing_the_server_stops_its_spares(code_app: Any, backend: str) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 2}) as code:
        pids = await spares_ready(pool_of(code), 2)
        assert all(alive(pid) for pid in pids)
    assert not any(alive(pid) for pid in pids)


async def test_the_idle_reaper_never_stops_an_interpreter_a_call_took_while_it_stopped_another(
    code_app: Any, backend: str
) -> None:
    async with code_app(code={**FAST, "interpreter_idle_seconds": 60.0}) as code:
        pool = pool_of(code)
        now = [0.0]
        pool.clock = lambda: now[0]
        first, second = new_trace(), new_trace()
        await cell(code, first, "x = 1")
        await cell(code, second, "y = 2")
        now[0] = 100.0  # both idle past the limit
        closing, release = asyncio.Event(), asyncio.Event()
        session = pool.live[first].session
        close = session.close

        async def slow_close(grace: float = 0.0) -> int | None:
            closing.set()
            await release.wait()
            return await close(grace)

        session.close = slow_close  # type: ignore[method-assign]
        reaping = asyncio.ensure_future(pool.reap())
        await closing.wait()  # the reaper is stopping `first`; `second` is on its list too
        async with pool.use(second, code_state_marker(pool, second)) as (interpreter, lost):
            release.set()
            await asyncio.sleep(0.2)  # the reaper goes on meanwhile
            answer = await interpreter.cell("y", {}, pool.limits)
        await reaping
    assert lost is None and answer.value == "2"  # the call ran in its interpreter, not killed under it


def code_state_marker(pool: InterpreterPool, trace: str) -> dict[str, Any]:
    """The marker the rollout's state holds for its interpreter (its last call's)."""
    return pool.live[trace].marker()


async def test_a_call_that_waited_for_a_grade_finds_a_stopped_interpreter_said_so(
    code_app: Any, backend: str
) -> None:
    """A call waits for the interpreter while a grade's check holds it; the grade stops it (the check
    killed it): the call starts a new one and says why, never a server error."""
    async with code_app(code=FAST) as code:
        pool = pool_of(code)
        trace = new_trace()
        await cell(code, trace, "x = 1")
        marker = code_state_marker(pool, trace)
        waiting: asyncio.Future[tuple[int, str | None]] | None = None

        async def call() -> tuple[int, str | None]:
            async with pool.use(trace, marker) as (interpreter, lost):
                return id(interpreter), lost

        async with pool.held(trace, marker) as held:
            waiting = asyncio.ensure_future(call())
            await asyncio.sleep(0.1)  # the call now waits for the lock
            await pool.discard(trace, "a grade's check stopped it")
        taken, lost = await waiting
    assert taken != id(held)
    assert lost == "a grade's check stopped it"


async def test_a_call_cancelled_while_its_interpreter_starts_leaves_nothing_held(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 0}) as code:
        pool = pool_of(code)
        started: list[Any] = []
        ready = Interpreter.ready

        async def never_ready(self: Interpreter) -> None:
            started.append(self)
            await asyncio.sleep(3600)

        monkeypatch.setattr(Interpreter, "ready", never_ready)
        trace = new_trace()

        async def call() -> None:
            async with pool.use(trace, None):
                pass

        task = asyncio.ensure_future(call())
        for _ in range(300):
            if started:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.setattr(Interpreter, "ready", ready)
        process = started[0].session.process
        await asyncio.wait_for(process.wait(), 10)
        again = await cell(code, trace, "2 + 2")
    assert trace not in pool.live or pool.live[trace] is not started[0]
    assert process.returncode is not None  # its process stopped, its cgroup given back
    assert again["value"] == "4"  # and the rollout's next call works


async def test_a_forged_report_of_more_files_than_the_workspace_holds_keeps_none(
    code_app: Any, backend: str
) -> None:
    """A cell answers for itself (its own id) with a report of 60 files: the workspace's limits are
    checked on the server, so nothing of it is kept."""
    forge = (
        "import base64, json, struct, sys\n"
        "driver, request = sys._getframe(2).f_locals['self'], sys._getframe(2).f_locals['request']\n"
        "report = b'S'\n"
        "for i in range(60):\n"
        "    name, content = f'f{i}.txt'.encode(), b'x'\n"
        "    report += b'F' + struct.pack('>I', len(name)) + name\n"
        "    report += struct.pack('>I', len(content)) + content\n"
        "report += b'Z'\n"
        "answer = {'id': request['id'], 'value': None, 'exception': None, 'stdout': '', 'stderr': '',\n"
        "          'stdout_total': 0, 'stderr_total': 0, 'files': base64.b64encode(report).decode()}\n"
        "body = json.dumps(answer).encode()\n"
        "with open(driver.frames, 'wb', closefd=False) as pipe:\n"
        "    pipe.write(struct.pack('>I', len(body)) + body)\n"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        forged = await cell(code, trace, forge)
        listed = json.loads(await code.call(trace, "list_files", {}, task_id=TASK))
    assert "(no change to the files was kept: the workspace may hold at most 50 files)" in forged.get(
        "files_not_kept", []
    ), forged
    assert sorted(entry["path"] for entry in listed) == ["examples.py", "solution.py"]


async def test_a_file_written_where_a_cell_left_an_empty_directory_reaches_the_next_cell(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "import os\nos.mkdir('d')")
        written = await code.call(trace, "write_file", {"path": "d", "content": "text"}, task_id=TASK)
        seen = await cell(code, trace, "open('d').read()")
        read = await code.call(trace, "read_file", {"path": "d"}, task_id=TASK)
    assert written.startswith("wrote "), written
    assert seen["value"] == "'text'", seen  # the tool's file won over the empty directory
    assert read == "text"


async def files_of(code: CodeClient, trace: str) -> dict[str, str]:
    """The rollout's stored files, as `read_file` answers them."""
    listing = json.loads(await code.call(trace, "list_files", {}, task_id=TASK))
    return {
        entry["path"]: await code.call(trace, "read_file", {"path": entry["path"]}, task_id=TASK)
        for entry in listing
    }


# A cell leaves something where a tool then writes a file; the rollout's file wins in the interpreter, and
# nothing of what stood there decides where the file goes or what the rollout keeps.
IN_THE_WAY = {
    "read-only-file": (
        "import os\nopen('notes.txt', 'w').write('OLD')\nos.chmod('notes.txt', 0o444)",
        "notes.txt",
    ),
    "read-only-directory": (
        "import os\nos.mkdir('pkg')\nopen('pkg/a.py', 'w').write('A')\nos.chmod('pkg', 0o555)",
        "pkg/b.py",
    ),
    "unreadable-directory": ("import os\nos.mkdir('pkg')\nos.chmod('pkg', 0)", "pkg/b.py"),
    "directory-of-binary-files": (
        "import os\nos.mkdir('out')\nopen('out/m.pkl', 'wb').write(b'\\x80\\xff')",
        "out",
    ),
    "binary-file-where-a-directory-goes": ("open('a', 'wb').write(b'\\xff\\xfe')", "a/b.txt"),
    "link-to-another-file": ("import os\nos.symlink('solution.py', 'sol.py')", "sol.py"),
    "link-to-another-directory": ("import os\nos.mkdir('lib')\nos.symlink('lib', 'pkg')", "pkg/x.py"),
    "fifo": ("import os\nos.mkfifo('notes.txt')", "notes.txt"),
}


@pytest.mark.parametrize("case", sorted(IN_THE_WAY))
async def test_a_file_a_tool_wrote_replaces_what_a_cell_left_in_its_way(
    code_app: Any, backend: str, case: str
) -> None:
    setup, path = IN_THE_WAY[case]
    async with code_app(code=FAST) as code:
        trace = new_trace()
        first = await cell(code, trace, setup)
        before = await files_of(code, trace)
        written = await code.call(trace, "write_file", {"path": path, "content": "NEW = 1\n"}, task_id=TASK)
        seen = await cell(code, trace, f"open({path!r}).read()")
        after = await files_of(code, trace)
    assert isinstance(first, dict) and "exception" not in first, first
    assert written.startswith("wrote "), written
    assert isinstance(seen, dict) and seen["value"] == repr("NEW = 1\n"), seen
    assert "files_not_kept" not in seen, seen
    assert after[path] == "NEW = 1\n"
    # Every other file the rollout had is as it was (the solution not written through a link, say).
    assert {name: text for name, text in after.items() if name != path} == {
        name: text for name, text in before.items() if name != path
    }


async def test_a_file_the_interpreter_could_not_take_is_kept_and_sent_again(
    code_app: Any, backend: str
) -> None:
    """A cell fills the interpreter's workspace (a binary file the rollout does not keep); a tool then
    writes a file the interpreter has no room for: the cell's answer says so, the rollout keeps the file
    (never deleted or put back by what the interpreter had), and once there is room it is placed."""
    fill = (
        "number = 0\n"
        "try:\n"
        "    while True:\n"  # files of 1 MiB (a run's largest) until the workspace's file system is full
        "        with open(f'fill{number}.bin', 'wb') as handle:\n"
        "            handle.write(b'\\xff' * (1 << 20))\n"
        "        number += 1\n"
        "except OSError:\n"
        "    pass\n"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, fill)
        written = await code.call(trace, "write_file", {"path": "new.txt", "content": "NEW"}, task_id=TASK)
        empty = "import glob, os\nfor name in glob.glob('fill*.bin'):\n    os.remove(name)\n"
        full = await cell(code, trace, empty)
        stored = await code.call(trace, "read_file", {"path": "new.txt"}, task_id=TASK)
        placed = await cell(code, trace, "open('new.txt').read()")
    assert written.startswith("wrote "), written
    assert any(
        entry.startswith("new.txt (could not be placed in the interpreter's workspace")
        for entry in full.get("files_not_kept", [])
    ), full
    assert stored == "NEW"  # the rollout's file was neither put back nor deleted
    assert placed["value"] == "'NEW'" and "files_not_kept" not in placed, placed


HOLDS_EVERY_DESCRIPTOR = (
    "import os\nheld = []\ntry:\n    while True:\n        held.append(os.open('/dev/null', os.O_RDONLY))\n"
    "except OSError:\n    pass\n"
)


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(HOLDS_EVERY_DESCRIPTOR, id="every-descriptor-held"),
        pytest.param("import os\nos.chmod('/workspace', 0)", id="workspace-unreadable"),
        pytest.param("import os\nos.makedirs('a/' + '/'.join(['d'] * 40))", id="deep-tree-in-the-way"),
    ],
)
async def test_what_a_cell_leaves_never_stops_the_next_cell_from_getting_the_files(
    code_app: Any, backend: str, setup: str
) -> None:
    """After a cell that holds every descriptor it may have, makes the workspace unreadable or leaves a deep
    tree where a file goes, the next cell runs (never a stopped interpreter), and a file a tool wrote
    meanwhile is either placed or said not placed and kept."""
    async with code_app(code=FAST) as code:
        trace = new_trace()
        first = await cell(code, trace, setup)
        written = await code.call(trace, "write_file", {"path": "a", "content": "A"}, task_id=TASK)
        second = await cell(code, trace, "41 + 1")
        stored = await code.call(trace, "read_file", {"path": "a"}, task_id=TASK)
    assert isinstance(first, dict) and "exception" not in first, first
    assert written.startswith("wrote "), written
    assert isinstance(second, dict) and second["value"] == "42", second
    assert stored == "A"
    not_placed = [
        entry for entry in second.get("files_not_kept", []) if entry.startswith("a (could not be placed")
    ]
    assert setup == HOLDS_EVERY_DESCRIPTOR or not not_placed, second


async def test_a_refused_cells_changes_never_come_back_from_where_its_walk_could_not_look(
    code_app: Any, backend: str
) -> None:
    """A refused cell changed files under a directory it then made unreadable, and overwrote a rollout's
    file with bytes the rollout cannot keep: the rollout's versions are what the interpreter holds next."""
    refused_cell = (
        "import os\nopen('d/x.txt', 'w').write('CELL')\nos.chmod('d', 0)\n"
        "open('examples.py', 'wb').write(b'\\xff')\n"
        f"for i in range({LIMITS.max_files + 5}):\n    open(f'f{{i}}.txt', 'w').write('x')\n"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await code.write(trace, "d/x.txt", "STORED", task_id=TASK)
        before = await files_of(code, trace)
        refused = await cell(code, trace, refused_cell)
        later = await cell(
            code,
            trace,
            "import os\nos.chmod('d', 0o755)\nopen('d/x.txt').read(), open('examples.py', 'rb').read()[:1]",
        )
        after = await files_of(code, trace)
    assert any("no change to the files was kept" in entry for entry in refused["files_not_kept"]), refused
    assert later["value"] == repr(("STORED", before["examples.py"].encode()[:1])), later
    assert after == before


async def test_a_cells_changes_the_workspace_refuses_are_undone_in_the_interpreter(
    code_app: Any, backend: str
) -> None:
    """A cell's changes over the workspace's limits are refused as a whole, and the interpreter gets the
    rollout's files back with the next call: they never come back with a later cell's."""
    too_many = "import os\nos.remove('examples.py')\nopen('solution.py', 'w').write('EDITED')\n" + (
        f"for i in range({LIMITS.max_files + 5}):\n    open(f'f{{i}}.txt', 'w').write('x')\n"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        before = await files_of(code, trace)
        refused = await cell(code, trace, too_many)
        later = await cell(
            code, trace, "import glob\nsorted(glob.glob('*.py')), open('solution.py').read()[:6]"
        )
        after = await files_of(code, trace)
    assert any("no change to the files was kept" in entry for entry in refused["files_not_kept"]), refused
    assert after == before
    assert later["value"] == repr((["examples.py", "solution.py"], before["solution.py"][:6])), later


TICKING = (
    "import subprocess, sys, threading, time\n"
    'TICK = \'import time\\nwhile True:\\n    open("ticks", "a").write("x")\\n    time.sleep(0.01)\\n\'\n'
    "ticker = subprocess.Popen([sys.executable, '-c', TICK])\n"
    "counted = []\n"
    "def count():\n"
    "    while True:\n"
    "        counted.append(1)\n"
    "        time.sleep(0.01)\n"
    "threading.Thread(target=count, daemon=True).start()\n"
    "time.sleep(0.1)\n"
)


async def test_what_a_cell_leaves_running_waits_for_the_rollouts_next_call(
    code_app: Any, backend: str
) -> None:
    """A child process and a thread a cell started tick every 10 ms; between the rollout's calls they are
    stopped (after 50 ms), so a second of the model's turn gives them no ticks, and they go on in the
    next call."""
    async with code_app(code=FAST) as code:
        if pool_of(code).sandbox.memory.per_run is False:
            pytest.skip("no cgroup lists an interpreter's processes here")
        trace = new_trace()
        await cell(code, trace, TICKING)
        first = await cell(code, trace, "(len(open('ticks').read()), len(counted))")
        await asyncio.sleep(1.0)  # the model's turn
        second = await cell(code, trace, "(len(open('ticks').read()), len(counted))")
        third = await cell(code, trace, "time.sleep(0.3)\n(len(open('ticks').read()), len(counted))")
    ticks = [eval(answer["value"]) for answer in (first, second, third)]
    # Over the second between calls both would have ticked ~100 times; stopped, a few at most.
    assert ticks[1][0] - ticks[0][0] < 40 and ticks[1][1] - ticks[0][1] < 40, ticks
    assert ticks[2][0] - ticks[1][0] >= 10 and ticks[2][1] - ticks[1][1] >= 10, ticks  # running in a call


async def test_a_call_cut_short_while_its_interpreter_stops_leaves_the_next_call_a_new_one(
    code_app: Any, backend: str
) -> None:
    """A cell writes a frame no driver writes and runs on: its interpreter is being stopped (a grace for
    it to exit, then killed) when the call is cancelled (its deadline). The rollout's next call, within
    that grace, waits for the stop and gets a new interpreter with the reason; it never spins on the one
    being stopped (the event loop would serve nothing else again)."""
    garbage = (
        "import struct, sys, time\n"
        "driver = sys._getframe(2).f_locals['self']\n"
        "with open(driver.frames, 'wb', closefd=False) as pipe:\n"
        "    pipe.write(struct.pack('>I', 2) + b'{}')\n"
        "time.sleep(30)\n"
    )
    spun: list[bool] = []

    def alarm(signum: int, frame: Any) -> None:
        spun.append(True)
        raise AssertionError("the event loop did not come back for 10 seconds")

    async with code_app(code=FAST) as code:
        pool = pool_of(code)
        trace = new_trace()
        async with pool.use(trace, None) as (interpreter, _):
            marker = interpreter.marker()

        async def run_garbage() -> None:
            async with pool.use(trace, marker) as (held, _):
                await held.cell(garbage, {}, pool.limits)

        task = asyncio.ensure_future(run_garbage())
        for _ in range(100):  # the server has read the frame and is stopping the interpreter
            await asyncio.sleep(0.02)
            if interpreter.session.closed:
                break
        assert interpreter.session.closed and interpreter.session.process.returncode is None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, 10.0)
        try:
            async with pool.use(trace, marker) as (fresh, lost):
                pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    assert not spun
    assert fresh is not interpreter and lost is not None, lost
    assert interpreter.session.process.returncode is not None  # stopped, not left running


PING_PONG = (
    "import os, signal, subprocess, sys, time\n"
    "PING = '''import os, signal, sys, time\n"
    "mine, theirs, ticks = sys.argv[1:4]\n"
    "open(mine + '.new', 'w').write(str(os.getpid()))\n"
    "os.rename(mine + '.new', mine)\n"
    "while not os.path.exists(theirs):\n"
    "    time.sleep(0.001)\n"
    "other, last = int(open(theirs).read()), 0.0\n"
    "while True:\n"
    "    os.kill(other, signal.SIGCONT)\n"
    "    if time.monotonic() - last > 0.01:\n"
    "        last = time.monotonic()\n"
    "        open(ticks, 'a').write('x')\n"
    "'''\n"
    "pair = [subprocess.Popen([sys.executable, '-c', PING, *names]) for names in\n"
    "        (('a.pid', 'b.pid', 'a.ticks'), ('b.pid', 'a.pid', 'b.ticks'))]\n"
    "time.sleep(0.2)\n"
)
TICKS = "(len(open('a.ticks').read()), len(open('b.ticks').read()))"


async def test_processes_that_continue_each_other_are_stopped_between_calls_too(
    code_app: Any, backend: str
) -> None:
    """Two processes a cell left running send each other SIGCONT without pause, so that one stopped is
    continued by the other: the stop is checked again and repeated until both are stopped at once."""
    async with code_app(code=FAST) as code:
        if pool_of(code).sandbox.memory.per_run is False:
            pytest.skip("no cgroup lists an interpreter's processes here")
        trace = new_trace()
        await cell(code, trace, PING_PONG)
        first = await cell(code, trace, TICKS)
        await asyncio.sleep(1.0)  # the model's turn
        second = await cell(code, trace, TICKS)
        await cell(code, trace, "for process in pair:\n    process.kill()")
    before, after = eval(first["value"]), eval(second["value"])
    # Running, each would tick ~100 times in that second; stopped, a few at most.
    assert after[0] - before[0] < 40 and after[1] - before[1] < 40, (before, after)


# A thread of the cell, in the driver itself, ticking every 10 ms.
TICKER = (
    "import threading, time\n"
    "ticks = []\n"
    "def tick():\n"
    "    while True:\n"
    "        ticks.append(1)\n"
    "        time.sleep(0.01)\n"
    "threading.Thread(target=tick, daemon=True).start()\n"
)
# Makes bwrap's pid 1 in the sandbox (a process of the cells' uid that runs no cell) send SIGCONT to every
# process it can, every millisecond: the cell attaches to it with ptrace, writes this loop where it stands
# and lets it go. x86-64: kill(-1, SIGCONT); nanosleep({0, 1000000}); again.
CONTINUE_ALL_LOOP = (
    "b83e000000"  # mov eax, 62 (kill)
    "bfffffffff"  # mov edi, -1 (every process it may signal)
    "be12000000"  # mov esi, 18 (SIGCONT)
    "0f05"  # syscall
    "6840420f00"  # push 1000000 (ns)
    "6a00"  # push 0 (s)
    "4889e7"  # mov rdi, rsp
    "31f6"  # xor esi, esi
    "b823000000"  # mov eax, 35 (nanosleep)
    "0f05"  # syscall
    "4883c410"  # add rsp, 16
    "ebd6"  # jmp to the start
)
PTRACE_PID_1 = (
    "import ctypes, os, struct\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.ptrace.restype = ctypes.c_long\n"
    "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
    "assert libc.ptrace(16, 1, None, None) == 0, os.strerror(ctypes.get_errno())\n"  # PTRACE_ATTACH
    "os.waitpid(1, 0x40000000)\n"  # __WALL
    "regs = (ctypes.c_ulonglong * 27)()\n"
    "assert libc.ptrace(12, 1, None, ctypes.addressof(regs)) == 0\n"  # PTRACE_GETREGS
    f"code = bytes.fromhex({CONTINUE_ALL_LOOP!r})\n"
    "code += bytes(-len(code) % 8)\n"
    "for at in range(0, len(code), 8):\n"  # PTRACE_POKETEXT at its instruction pointer
    "    assert libc.ptrace(4, 1, regs[16] + at, struct.unpack('<Q', code[at:at + 8])[0]) == 0\n"
    "regs[15] = 2**64 - 1\n"  # orig_rax -1: no system call restarted
    "assert libc.ptrace(13, 1, None, ctypes.addressof(regs)) == 0\n"  # PTRACE_SETREGS
    "assert libc.ptrace(17, 1, None, None) == 0\n"  # PTRACE_DETACH
)
# POSIX timers of the driver that the kernel fires as SIGCONT every millisecond (no process of the session
# sends them); re-armed whenever the cell's thread runs.
SIGCONT_TIMERS = (
    "import ctypes, signal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "class sigevent(ctypes.Structure):\n"
    "    _fields_ = [('value', ctypes.c_void_p), ('signo', ctypes.c_int), ('notify', ctypes.c_int),\n"
    "                ('pad', ctypes.c_byte * 48)]\n"
    "signal.signal(signal.SIGCONT, lambda *_: None)\n"
    "timers = []\n"
    "def arm():\n"
    "    for timer in timers:\n"
    "        libc.timer_delete(timer)\n"
    "    timers.clear()\n"
    "    for k in range(8):\n"
    "        timer = ctypes.c_void_p()\n"
    "        event = sigevent(None, signal.SIGCONT, 0)\n"
    "        assert libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) == 0\n"
    "        first = 100_000 + k * 110_000\n"
    "        libc.timer_settime(timer, 0, (ctypes.c_long * 4)(0, 1_000_000, 0, first), None)\n"
    "        timers.append(timer)\n"
    "arm()\n"
    "def tick():\n"
    "    while True:\n"
    "        ticks.append(1)\n"
    "        arm()\n"
    "        time.sleep(0.01)\n"
    "threading.Thread(target=tick, daemon=True).start()\n"
)


def frozen_by_cgroup(code: CodeClient) -> bool:
    """The sandbox freezes interpreters by cgroup here; skip (no v2 hierarchy at all) or fail otherwise."""
    if freezer.v2_root() is None:
        pytest.skip("no cgroup v2 hierarchy: interpreters are stopped by signals here")
    return pool_of(code).sandbox.freezer.mechanism != "signals"


@pytest.mark.parametrize(
    "escape",
    [
        pytest.param(
            PTRACE_PID_1,
            id="ptrace-of-pid-1",
            marks=pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 machine code"),
        ),
        pytest.param("", id="sigcont-timers"),
    ],
)
async def test_nothing_a_cell_does_continues_its_interpreter_between_calls(
    code_app: Any, backend: str, escape: str
) -> None:
    """The kernel's freezer holds every process of the session, bwrap's pid 1 and the driver included:
    neither a SIGCONT sent by a process the cell took over nor one fired by the kernel's timers lets the
    cell's thread run in the model's turn."""
    async with code_app(code=FAST) as code:
        assert frozen_by_cgroup(code)
        trace = new_trace()
        setup = await cell(code, trace, TICKER + (escape or SIGCONT_TIMERS))
        assert isinstance(setup, dict) and not setup.get("exception"), setup
        first = await cell(code, trace, "len(ticks)")
        await asyncio.sleep(1.0)  # the model's turn
        second = await cell(code, trace, "len(ticks)")
        third = await cell(code, trace, "time.sleep(0.3)\nlen(ticks)")
    ticks = [int(answer["value"]) for answer in (first, second, third)]
    # Running, the thread would tick ~100 times in that second; frozen, a few at most.
    assert ticks[1] - ticks[0] < 40, ticks
    assert ticks[2] - ticks[1] >= 10, ticks  # and it runs again in a call


def test_a_directory_that_cannot_be_opened_for_want_of_a_descriptor_is_left_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Placing a file under `pkg` when opening `pkg` fails for want of a descriptor (a cell's thread holds
    them for a moment): the file is said not placed, and nothing of `pkg` is removed."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("A")
    real_open = os.open

    def short_of_descriptors(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "pkg":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(harness_interpreter.os, "open", short_of_descriptors)
    failed = harness_interpreter.apply_files(str(tmp_path), {"pkg/c.py": "C"})
    monkeypatch.undo()
    assert failed == [["pkg/c.py", os.strerror(errno.EMFILE)]]
    assert sorted(path.name for path in (tmp_path / "pkg").iterdir()) == ["a.py"]


@pytest.mark.parametrize(
    "overwrite",
    [
        "open('solution.py', 'wb').write(b'\\xff\\xfe not UTF-8')",
        "open('solution.py', 'w').write('#' * 300_000)",
    ],
    ids=["not-utf8", "too-large"],
)
async def test_a_rollout_file_a_cell_overwrote_with_what_cannot_be_kept_is_the_rollouts_again_next_cell(
    code_app: Any, backend: str, overwrite: str
) -> None:
    """The rollout keeps its version (and says the cell's was not kept); the next cell sees that version,
    as read_file, run_python and the grader do: the two never drift apart."""
    async with code_app(code=FAST) as code:
        trace = new_trace()
        original = await code.call(trace, "read_file", {"path": "solution.py"}, task_id=TASK)
        answer = await cell(code, trace, overwrite)
        stored = await code.call(trace, "read_file", {"path": "solution.py"}, task_id=TASK)
        seen = await cell(code, trace, "open('solution.py', 'rb').read().decode()")
    assert any(entry.startswith("solution.py (") for entry in answer["files_not_kept"]), answer
    assert stored == original
    assert seen["value"] == repr(original) and "files_not_kept" not in seen, seen


async def test_a_file_the_rollout_cannot_keep_is_named_once_while_the_box_holds_it_unchanged(
    code_app: Any, backend: str
) -> None:
    """The interpreter keeps its own files the rollout cannot (a binary file); the answer names one when a
    cell makes or changes it, not again with every later cell; a cell writing it again over the rollout's
    version is named again."""
    async with code_app(code=FAST) as code:
        trace = new_trace()
        made = await cell(code, trace, "open('blob.bin', 'wb').write(b'\\xff1')")
        quiet = await cell(code, trace, "len(open('blob.bin', 'rb').read())")
        changed = await cell(code, trace, "open('blob.bin', 'wb').write(b'\\xff22')")
        again = await cell(code, trace, "1")
        overwrite = "open('solution.py', 'wb').write(b'\\xfe')"
        first = await cell(code, trace, overwrite)
        second = await cell(code, trace, overwrite)  # the rollout's version was put back before it ran
    assert made["files_not_kept"] == ["blob.bin (not UTF-8 text)"], made
    assert quiet["value"] == "2" and "files_not_kept" not in quiet, quiet
    assert changed["files_not_kept"] == ["blob.bin (not UTF-8 text)"], changed
    assert "files_not_kept" not in again, again
    assert first["files_not_kept"] == ["solution.py (not UTF-8 text)"], first
    assert second["files_not_kept"] == ["solution.py (not UTF-8 text)"], second


async def test_showing_a_value_larger_than_the_memory_left_keeps_the_state(
    code_app: Any, backend: str
) -> None:
    """A cell's value is shown cut to 16 KiB; of a string, bytes or a builtin container only that much
    repr is made (a whole repr of 60 MiB of bytes is 240 MiB: over the cap, and the state was lost)."""
    mib = 1024 * 1024
    async with code_app(
        code={**FAST, "interpreter_cell_seconds": 20.0, "run_memory_bytes": 128 * mib}
    ) as code:
        trace = new_trace()
        made = await cell(code, trace, f"keep = 1\ndata = bytes({60 * mib})\nlen(data)")
        shown = await cell(code, trace, "data")
        nested = await cell(code, trace, "[data, {'k': data}]")
        after = await cell(code, trace, "keep")
    assert made["value"] == str(60 * mib)
    assert shown["value"].startswith("b'\\x00\\x00") and shown["value"].endswith(
        "[value truncated: shown in part]"
    )
    assert nested["value"].startswith("[b'\\x00") and len(nested["value"]) < 20_000
    assert after["value"] == "1"


async def test_calls_without_a_trace_id_leave_no_interpreter_to_push_a_rollouts_out(
    code_app: Any, backend: str
) -> None:
    """A call without a trace_id is a rollout of its own that no later call reaches: its interpreter is
    let go at the call's end, never kept live against the cap."""
    async with code_app(code={**FAST, "interpreter_max": 2}) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        answers = []
        for _ in range(3):
            body = {"type": "function_call", "name": "python", "arguments": json.dumps({"code": "1 + 1"})}
            response = await code.http.post("/tools/python", json=body)
            answers.append(json.loads(response.json()["output"]))
        live = list(pool_of(code).live)
        kept = await cell(code, trace, "x")
    assert [answer["value"] for answer in answers] == ["2", "2", "2"]
    assert live == [trace]
    assert kept["value"] == "1"


async def test_an_interpreter_whose_rollouts_state_was_lost_says_so(code_app: Any, backend: str) -> None:
    """The rollout's state expired (or was evicted) while its interpreter lived: the next call is told
    that the earlier state is lost, never run silently in a fresh interpreter."""
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        await cell(code, trace, "x")
        await forget_state(backend, trace)
        after = await cell(code, trace, "x")
        again = await cell(code, trace, "x = 2\nx")
    assert isinstance(after, str) and after.startswith(f"Error: {RESTARTED}") and "state was lost" in after
    assert again["value"] == "2"


async def test_a_value_whose_repr_never_ends_is_not_shown_and_the_state_is_kept(
    code_app: Any, backend: str
) -> None:
    """The cell's code ended; only showing its value does not: given up before the call's time is out,
    so the interpreter and its state stay (a cell's own SIGALRM timer is put back afterwards)."""
    async with code_app(code={**FAST, "interpreter_cell_seconds": 2.0}) as code:
        trace = new_trace()
        await cell(code, trace, "keep = 1\nclass Slow:\n    def __repr__(self):\n        while True: pass\n")
        shown = await cell(
            code,
            trace,
            "import signal\nrang = []\nsignal.signal(signal.SIGALRM, lambda *a: rang.append(1))\n"
            "signal.setitimer(signal.ITIMER_REAL, 1.2)\nSlow()",
        )
        after = await cell(code, trace, "import time\ntime.sleep(0.3)\n(keep, type(_).__name__, rang)")
    assert "not shown" in shown["value"], shown
    assert after["value"] == "(1, 'Slow', [1])", after
