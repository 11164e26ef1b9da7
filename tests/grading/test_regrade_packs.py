"""A run graded by one grader, its live state flushed, then scored by a grader that never graded it and reads
the state (retail's database check, the code pack's hidden tests): the kept final state stands in."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import httpx

from app.deps import app_state
from tests.code.conftest import CodeClient, all_tasks
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.grading.test_routes import stored_grades, write_graders
from tests.grading.test_state_lost import forget_state
from tests.retail import corpus
from tests.retail.test_http_replay import mutates, run_calls
from tools.code import data as code_data
from tools.code import pack as code_pack
from tools.retail import pack as retail_pack

# A grader that reads no state: any answer passes.
ANSWERED = {
    "answered": {
        "type": "string_check",
        "name": "answered",
        "operation": "ne",
        "input": "{{ sample.output_text }}",
        "reference": "",
    }
}


async def grade(client: httpx.AsyncClient, grader: str, trace: str, item: dict[str, Any], run: str) -> float:
    response = await client.post(
        f"/grade/{grader}",
        json={"sample": {"output_text": "Done."}, "item": item, "trace_id": trace},
        headers={"X-Sparring-Run": run},
    )
    assert response.status_code == 200, response.text
    return float(response.json()["score"])


async def test_retail_regraded_by_its_database_check_after_the_state_was_flushed(
    app_factory: AppFactory, tmp_path: Path, backend: str
) -> None:
    data = corpus.fetch()
    graders = write_graders(tmp_path, ANSWERED)
    calls = corpus.replay_calls("0")
    last_write = max(i for i, call in enumerate(calls) if mutates(call))
    run, full, dropped = f"lab-{new_trace()}", new_trace(), new_trace()
    item = {"task_id": "0"}
    settings = {"packs": [retail_pack], "key": ADMIN_KEY, "pack_settings": {"retail": {"data": data}}}
    async with app_factory(**settings, graders_file=graders) as client:
        await run_calls(client, full, calls)
        await run_calls(client, dropped, calls[:last_write] + calls[last_write + 1 :])
        for trace in (full, dropped):
            assert await grade(client, "answered", trace, item, run) == 1.0
            await forget_state(backend, trace)
    async with app_factory(**settings, graders_file=graders) as client:  # in memory: the state is gone
        report = await app_state(client.app).grading.regrade("retail", run=run)
        assert (report.rollouts, report.skipped, report.failed, report.changed) == (2, 0, 0, 2)
        scores = {g.trace_id: g.score for g in await stored_grades(client, run=run, grader="retail")}
    # The full replay reaches the gold database; without its last write it does not.
    assert scores == {full: 1.0, dropped: 0.0}


SOLUTION = """\
for i, a in enumerate(numbers):
    for b in numbers[i + 1:]:
        if abs(a - b) < threshold:
            return True
return False
"""


async def test_code_regraded_by_its_hidden_tests_after_the_state_was_flushed(
    app_factory: AppFactory, tmp_path: Path, backend: str
) -> None:
    cached = code_data.DATA.fetch(code_data.DATA.cache_dir(corpus.HOME))
    graders = write_graders(tmp_path, ANSWERED)
    task = "HumanEval/0"
    prompt = all_tasks()[task].prompt
    run, right, wrong = f"lab-{new_trace()}", new_trace(), new_trace()
    settings = {"packs": [code_pack], "key": ADMIN_KEY, "pack_settings": {"code": {"data": cached}}}
    async with app_factory(**settings, graders_file=graders) as client:
        code = CodeClient(client)
        await code.write(right, "solution.py", prompt + textwrap.indent(SOLUTION, "    "), task_id=task)
        await code.write(wrong, "solution.py", prompt + "    return False\n", task_id=task)
        for trace in (right, wrong):
            assert await grade(client, "answered", trace, {"task_id": task}, run) == 1.0
            await forget_state(backend, trace)
    async with app_factory(**settings, graders_file=graders) as client:
        report = await app_state(client.app).grading.regrade("code", run=run)
        assert (report.rollouts, report.skipped, report.failed) == (2, 0, 0)
        scores = {g.trace_id: g.score for g in await stored_grades(client, run=run, grader="code")}
    assert scores == {right: 1.0, wrong: 0.0}
