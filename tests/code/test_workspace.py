"""The workspace tools over HTTP: starting files, paths, limits, runs that keep files, exactly-once writes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from typing import Any

import pytest

from tests.code.conftest import all_tasks, served_resources
from tests.conftest import new_trace
from tools.code.workspace import LIMITS

TASK = "HumanEval/0"


async def test_a_rollout_starts_from_the_tasks_files(code_app: Any) -> None:
    task = all_tasks()[TASK]
    async with code_app() as code:
        trace = new_trace()
        listed = json.loads(await code.call(trace, "list_files", {}, task_id=TASK))
        stub = await code.call(trace, "read_file", {"path": "solution.py"}, task_id=TASK)
        examples = await code.call(trace, "read_file", {"path": "examples.py"}, task_id=TASK)
        untasked = json.loads(await code.call(new_trace(), "list_files", {}, task_id=None))
    assert [entry["path"] for entry in listed] == ["examples.py", "solution.py"]
    assert stub == task.prompt
    assert "from solution import has_close_elements" in examples
    assert "assert result == True" in examples
    assert task.canonical_solution not in stub + examples  # the gold is never in the workspace
    assert untasked == []  # a row without a task id: an empty workspace


async def test_paths_stay_inside_the_workspace(code_app: Any) -> None:
    async with code_app() as code:
        trace = new_trace()
        answers = {
            path: await code.write(trace, path, "x", task_id=TASK)
            for path in ("../x.py", "/etc/passwd", "a/../../b", "./a", "a//b", "", ".hidden", "__pycache__/x")
        }
        nested = await code.write(trace, "pkg/helpers.py", "VALUE = 3\n", task_id=TASK)
        missing = await code.call(trace, "read_file", {"path": "nope.py"}, task_id=TASK)
    assert all(answer.startswith("Error: ") for answer in answers.values()), answers
    assert "relative to the workspace" in answers["/etc/passwd"]
    assert "inside the workspace" in answers["../x.py"]
    assert nested == "wrote 10 bytes to pkg/helpers.py"
    assert missing.startswith("Error: no file 'nope.py'")


async def test_limits_are_readable_errors(code_app: Any) -> None:
    async with code_app() as code:
        trace = new_trace()
        too_big = await code.write(trace, "big.txt", "x" * (LIMITS.max_file_bytes + 1), task_id=TASK)
        answers = [await code.write(trace, f"f{i}.txt", "x", task_id=TASK) for i in range(LIMITS.max_files)]
        listed = json.loads(await code.call(trace, "list_files", {}, task_id=TASK))
    assert too_big.startswith("Error: big.txt would be") and f"at most {LIMITS.max_file_bytes}" in too_big
    refused = [answer for answer in answers if answer.startswith("Error:")]
    assert refused and f"at most {LIMITS.max_files} files" in refused[0]
    assert len(listed) == LIMITS.max_files


async def test_a_run_answers_exit_code_output_and_time_and_keeps_its_files(code_app: Any) -> None:
    script = (
        "import os, sys\n"
        "from pkg.helpers import VALUE\n"
        "open('made.txt', 'w').write(f'{VALUE} {sys.argv[1:]}')\n"
        "os.remove('gone.txt')\n"
        "open('blob.bin', 'wb').write(bytes([0xff, 0xfe]))\n"
        "print('out', VALUE)\n"
        "print('err', file=sys.stderr)\n"
        "print('x' * 40000)\n"
        "sys.exit(3)\n"
    )
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "pkg/helpers.py", "VALUE = 3\n", task_id=TASK)
        await code.write(trace, "gone.txt", "bye", task_id=TASK)
        await code.write(trace, "main.py", script, task_id=TASK)
        ran = await code.run(trace, "main.py", task_id=TASK, args=["a", "b c"])
        made = await code.call(trace, "read_file", {"path": "made.txt"}, task_id=TASK)
        gone = await code.call(trace, "read_file", {"path": "gone.txt"}, task_id=TASK)
        listed = await code.call(trace, "list_files", {}, task_id=TASK)
    assert ran["exit_code"] == 3
    assert ran["stdout"].startswith("out 3\n")
    assert "[output truncated: " in ran["stdout"] and "bytes cut]" in ran["stdout"]
    assert ran["stderr"] == "err\n"
    assert ran["wall_seconds"] > 0
    assert ran["files_not_kept"] == ["blob.bin (not UTF-8 text)"]
    assert made == "3 ['a', 'b c']"
    assert gone.startswith("Error: no file")
    assert "blob.bin" not in listed and "__pycache__" not in listed


async def run_script(code: Any, files: dict[str, str], script: str) -> tuple[dict[str, Any], list[str]]:
    """A new rollout with `files` written, `script` run as main.py: its answer and the files it then lists."""
    trace = new_trace()
    for path, content in {**files, "main.py": script}.items():
        await code.write(trace, path, content, task_id=TASK)
    ran = await code.run(trace, "main.py", task_id=TASK)
    listing = json.loads(await code.call(trace, "list_files", {}, task_id=TASK))
    return ran, [entry["path"] for entry in listing]


@pytest.mark.parametrize("hidden", ["sub", "."])
async def test_a_directory_the_run_made_unreadable_keeps_what_was_in_it(code_app: Any, hidden: str) -> None:
    """The walk cannot list a directory the run made unreadable: its files were not seen, not deleted, and
    stay as they were (other changes of the run are kept)."""
    script = f"import os\nos.remove('gone.txt')\nos.chmod({hidden!r}, 0)\n"
    async with code_app() as code:
        ran, listed = await run_script(code, {"sub/a.py": "A = 1\n", "gone.txt": "bye"}, script)
    assert ran["exit_code"] == 0, ran
    assert "sub/a.py" in listed and "solution.py" in listed and "main.py" in listed, listed
    assert any("unreadable" in entry for entry in ran["files_not_kept"]), ran
    if hidden == "sub":
        assert "gone.txt" not in listed  # what the walk did see is kept
    else:
        assert "gone.txt" in listed  # nothing could be seen: nothing changes


async def test_a_name_the_workspace_cannot_hold_protects_nothing_else(code_app: Any) -> None:
    """A run moves a directory to a name no workspace path may have, and makes a file named like a
    reason: the moved files are gone from the rollout (their new name is said not kept) and what the run
    deleted is deleted; no name the run chose keeps other files from their fate."""
    script = (
        "import os\nos.rename('data', 'data (old)')\nopen(' (x)', 'w').write('x')\nos.remove('gone.txt')\n"
    )
    async with code_app() as code:
        ran, listed = await run_script(code, {"data/a.txt": "A", "gone.txt": "bye"}, script)
    assert ran["exit_code"] == 0, ran
    assert "data (old)/a.txt (not a valid workspace path)" in ran["files_not_kept"], ran
    assert "data/a.txt" not in listed and "gone.txt" not in listed, listed


async def test_a_run_stopped_for_its_output_says_its_files_were_not_kept(code_app: Any) -> None:
    script = "import os\nopen('made.txt', 'w').write('x')\nos.remove('examples.py')\nprint('x' * (5 << 20))\n"
    async with code_app() as code:
        ran, listed = await run_script(code, {}, script)
    assert ran["error"] == "stopped: it wrote more output than the limit", ran
    assert ran["files_not_kept"] == [
        "(the run was stopped before its files were read: no change was kept)"
    ], ran
    assert "made.txt" not in listed and "examples.py" in listed, listed


async def test_a_cut_short_walk_still_deletes_what_it_proves_gone(code_app: Any) -> None:
    """A run turns the file `out` into a directory holding `out/r.txt` and leaves more links than the walk
    reports (so it stops at its limit and deletions it cannot see are not made): what it did list proves
    `out` no longer a file, and the rollout never holds a file and a directory of one name."""
    script = (
        "import os\nos.remove('out')\nos.mkdir('out')\nopen('out/r.txt', 'w').write('R')\n"
        "for i in range(60):\n    os.symlink('solution.py', f'link{i}')\n"
    )
    async with code_app() as code:
        ran, listed = await run_script(code, {"out": "old"}, script)
    assert ran["exit_code"] == 0, ran
    assert any("stopped at a limit" in entry for entry in ran["files_not_kept"]), ran
    assert "out/r.txt" in listed and "out" not in listed, listed
    assert "solution.py" in listed and "main.py" in listed


async def test_run_examples_fails_on_the_stub_and_passes_on_the_gold(code_app: Any) -> None:
    task = all_tasks()[TASK]
    async with code_app() as code:
        trace = new_trace()
        stub = json.loads(await code.call(trace, "run_examples", {}, task_id=TASK))
        await code.write(trace, "solution.py", task.gold_solution, task_id=TASK)
        gold = json.loads(await code.call(trace, "run_examples", {}, task_id=TASK))
    assert stub["exit_code"] == 1 and "AssertionError" in stub["stderr"]
    assert gold["exit_code"] == 0 and gold["stdout"] == "all 2 examples passed\n"


async def test_a_retried_write_is_applied_once(code_app: Any) -> None:
    async with code_app() as code:
        trace = new_trace()
        first = await code.call(
            trace, "write_file", {"path": "a.txt", "content": "first"}, task_id=TASK, call_id="w1"
        )
        await code.call(
            trace, "write_file", {"path": "a.txt", "content": "second"}, task_id=TASK, call_id="w2"
        )
        retried = await code.call(
            trace, "write_file", {"path": "a.txt", "content": "first"}, task_id=TASK, call_id="w1"
        )
        content = await code.call(trace, "read_file", {"path": "a.txt"}, task_id=TASK)
        logged = (await code.http.get(f"/rollouts/{trace}")).json()
    assert retried == first == "wrote 5 bytes to a.txt"
    assert content == "second"  # the retry was answered from the ledger, not run again
    writes = [c["call_id"] for c in logged["timeline"] if c["tool"] == "write_file"]
    assert writes == ["w1", "w2"]


async def test_a_sandbox_that_cannot_start_is_an_outage_not_a_crash(
    code_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Exhausted:
        async def run(self, *args: Any, **kwargs: Any) -> Any:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    async with code_app() as code:
        served = served_resources(code.http)
        monkeypatch.setitem(served, "code", dataclasses.replace(served["code"], sandbox=Exhausted()))  # type: ignore[type-var]
        trace = new_trace()
        body = {
            "type": "function_call",
            "call_id": "call_run",
            "arguments": json.dumps({"path": "solution.py", "args": []}),
            "trace_id": trace,
            "item": {"task_id": TASK},
        }
        response = await code.http.post("/tools/run_python", json=body)
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"]
        assert "sandbox could not start" in response.json()["error"]["message"]
        monkeypatch.undo()
        # The call was given up, not answered: its retry runs for real once the sandbox is back.
        retried = await code.http.post("/tools/run_python", json=body)
        assert retried.status_code == 200
        assert json.loads(retried.json()["output"])["exit_code"] == 0


def test_the_review_diffs_writes_against_the_task_s_starting_files() -> None:
    from types import SimpleNamespace

    from tools.code.tools import files_at_start, pack

    task = all_tasks()[TASK]
    resources = SimpleNamespace(tasks=all_tasks())
    started = files_at_start(resources, {"task_id": TASK})  # type: ignore[arg-type]
    assert started == task.starting_files() and started["solution.py"] == task.prompt
    assert files_at_start(resources, {}) == {}  # type: ignore[arg-type]  # no task: an empty workspace
    assert pack.starting_files_of is files_at_start


def test_the_workspace_walk_reads_a_file_whole_up_to_its_limit(tmp_path: Any) -> None:
    """The run's report reads each file within the bytes the workspace has left, plus one (how a file
    over the limit is seen), whatever size it had when it was looked at."""
    from tools.code.harness_supervisor import read_upto

    small, big, empty = tmp_path / "small", tmp_path / "big", tmp_path / "empty"
    small.write_bytes(b"print(1)\n")
    big.write_bytes(bytes(range(256)) * 1024)  # 256 KiB
    empty.write_bytes(b"")
    assert read_upto(bytes(small), 9, 100) == b"print(1)\n"
    assert read_upto(bytes(empty), 0, 100) == b""
    # Grown since it was looked at (its size then: 10 bytes): read on to the end, or to the limit.
    assert read_upto(bytes(big), 10, 1 << 20) == big.read_bytes()
    assert read_upto(bytes(big), 10, 70_001) == big.read_bytes()[:70_001]
    # Shrunk since: what is there.
    assert read_upto(bytes(small), 4096, 100) == b"print(1)\n"
    assert read_upto(bytes(small), 9, 5) == b"print"


def test_the_workspace_walk_never_follows_a_link_put_in_place_while_it_reads(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of the run that is still dying (or one a cell left running) may swap a directory the walk
    has listed for a link to elsewhere: the walk reaches each directory and file from its parent's
    descriptor without following links, so it reads nothing outside the workspace."""
    import io

    from tools.code import harness_supervisor
    from tools.code.sandbox import parse_report

    workspace, outside = tmp_path / "workspace", tmp_path / "outside"
    (workspace / "d").mkdir(parents=True)
    (workspace / "d" / "mine.py").write_text("mine")
    (workspace / "main.py").write_text("print(1)")
    outside.mkdir()
    (outside / "secret.txt").write_text("not the run's")
    real_scandir = os.scandir
    listed: list[object] = []

    class Listing:
        """What os.scandir gives, usable as the walk uses it (iterated, or as a context manager)."""

        def __init__(self, entries: list[os.DirEntry[Any]]) -> None:
            self.entries = entries

        def __iter__(self) -> Any:
            return iter(self.entries)

        def __enter__(self) -> Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def scandir(path: Any) -> Listing:
        with real_scandir(path) as entries:
            listing = Listing(list(entries))
        listed.append(path)
        if len(listed) == 1:  # the root is listed: `d` becomes a link before the walk goes in
            shutil.rmtree(workspace / "d")
            (workspace / "d").symlink_to(outside, target_is_directory=True)
        return listing

    monkeypatch.setattr(harness_supervisor.os, "scandir", scandir)
    report = io.BytesIO()
    report.write(b"S")
    walk = harness_supervisor.Walk(report, str(workspace), 50, 1 << 20)
    walk.run()
    harness_supervisor.send(report, b"Z")
    monkeypatch.undo()
    parsed = parse_report(report.getvalue())
    assert parsed.files == {"main.py": b"print(1)"}, parsed
    assert "d" in " ".join(parsed.skipped), parsed  # the directory it could not enter is reported
