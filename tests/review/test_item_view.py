"""The item beside the rollout: the dataset row and sample a real grade was given, the item's scores."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import GRADER_KEY, new_trace
from tests.review.conftest import ADMIN, ReviewApp
from tests.review.test_ui_auth import login

GRADERS = {
    "exact": {
        "type": "string_check",
        "name": "exact",
        "operation": "eq",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
    }
}
LONG_POLICY = "Be terse. " * 150  # folded on the page


def graders_file(tmp_path: Path) -> Path:
    path = tmp_path / "graders.yaml"
    path.write_text(yaml.safe_dump(GRADERS))
    return path


def item(n: int) -> dict[str, Any]:
    return {
        "id": f"order-{n}",
        "messages": [
            {"role": "developer", "content": LONG_POLICY},
            {"role": "user", "content": f"What is the status of order {n}?"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "echo", "description": "Echo.", "parameters": {}}}
        ],
        "reference_answer": f"Order {n} shipped",
        "gold_calls": [{"name": "echo", "arguments": {"text": str(n)}}],
    }


def sample(text: str) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "output_text": text,
        "output_tools": [{"type": "function_call", "name": "echo", "arguments": '{"text": "7"}'}],
    }


async def grade(review: ReviewApp, trace: str, answer: str, n: int, run: str) -> None:
    response = await review.client.post(
        "/grade/exact",
        json={"sample": sample(answer), "item": item(n), "trace_id": trace},
        headers={"Authorization": f"Bearer {GRADER_KEY}", "X-Sparring-Run": run},
    )
    assert response.status_code == 200, response.text


async def test_the_rollout_page_shows_the_item_and_the_sample_it_was_graded_on(
    review_factory: Any, tmp_path: Path
) -> None:
    async with review_factory(graders_file=graders_file(tmp_path)) as review:
        run = f"run-{uuid.uuid4().hex[:8]}"
        right, wrong, other = new_trace(), new_trace(), new_trace()
        for trace in (right, wrong, other):
            await review.call("echo", {"text": "7"}, trace, call_id="c1", run=run)
        await grade(review, right, "Order 7 shipped", 7, run)
        await grade(review, wrong, "Order 7 is lost", 7, run)
        await grade(review, other, "Order 8 shipped", 8, run)

        graded_on = await review.api(f"/review/api/rollouts/{right}/graded-on")
        assert graded_on["grader"] == "exact" and graded_on["item_key"] == "id:order-7"
        assert graded_on["item"]["reference_answer"] == "Order 7 shipped"
        assert graded_on["answer"] == "Order 7 shipped"
        assert [t["name"] for t in graded_on["output_tools"]] == ["echo"]
        scores = graded_on["item_scores"]  # item 7 in this run: one 1, one 0
        assert (scores["rollouts"], scores["mean"], scores["variance"]) == (2, 0.5, 0.25)

        await login(review)
        page = (await review.client.get(f"/review/rollouts/{right}")).text
        dataset_row = page[page.index('id="dataset-row"') : page.index('id="graded-sample"')]
        fields = re.findall(r'data-field="([^"]+)"', dataset_row)
        assert fields == ["messages", "tools", "gold_calls", "reference_answer", "id"]  # prompt first
        assert "What is the status of order 7?" in dataset_row
        assert '<details class="folded"><summary>developer message' in dataset_row  # the long policy
        assert "1 tool: <span" in dataset_row and "Order 7 shipped" in dataset_row
        graded_sample = page[page.index('id="graded-sample"') :]
        assert '<pre class="answer">Order 7 shipped</pre>' in graded_sample
        assert '<ul class="output-tools"><li><span class="mono">echo</span>' in graded_sample
        # The item key links to every rollout of that item, with its mean and variance.
        assert f'href="/review?item=id%3Aorder-7&amp;run={run}"' in page
        assert 'id="item-mean">0.5<' in page and 'id="item-variance">0.25<' in page

        # A second grader: the page offers both, and shows the item of the one chosen.
        await review.grade(right, answer="Order 7 shipped", score=0.5, run=run, grader="judge")
        page = (await review.client.get(f"/review/rollouts/{right}")).text
        choice = page[page.index('id="grader-choice"') :]
        assert "<strong>judge</strong>" in choice and "?grader=exact" in choice
        assert "The grade did not keep its dataset row." in page  # the judge's grade has none
        page = (await review.client.get(f"/review/rollouts/{right}", params={"grader": "exact"})).text
        assert "<strong>exact</strong>" in page and "What is the status of order 7?" in page

        listed = (await review.client.get("/review", params={"item": "order-7", "run": run})).text
        assert 'data-total="2"' in listed and listed.count('class="rollout-row"') == 2
        listed = (
            await review.client.get("/review", params={"item": "order-7", "run": run, "grader": "exact"})
        ).text
        assert 'id="item-mean">0.5<' in listed and 'id="item-variance">0.25<' in listed


async def test_long_json_outputs_are_formatted_and_folded_with_their_size(review: ReviewApp) -> None:
    trace = new_trace()
    text = "x" * 3000
    await review.call("echo", {"text": text}, trace, call_id="c1")
    await login(review)
    page = (await review.client.get(f"/review/rollouts/{trace}")).text
    assert re.search(r'<details class="folded"><summary>output <span class="muted">· 3\.0 kB · 1 line', page)
    assert page.count(text) == 2  # the arguments and the folded output


async def test_a_number_beyond_64_bits_in_the_row_shows_and_exports(
    review_factory: Any, tmp_path: Path
) -> None:
    # Postgres' JSONB gives 1e20 back as the integer 100000000000000000000, which orjson cannot write:
    # the rollout page and the export must still show the row.
    async with review_factory(graders_file=graders_file(tmp_path)) as review:
        run = f"run-{uuid.uuid4().hex[:8]}"
        trace = new_trace()
        await review.call("echo", {"text": "7"}, trace, call_id="c1", run=run)
        row = {**item(7), "mass_kg": 1e20, "atoms": 2**70}
        response = await review.client.post(
            "/grade/exact",
            json={"sample": sample("Order 7 shipped"), "item": row, "trace_id": trace},
            headers={"Authorization": f"Bearer {GRADER_KEY}", "X-Sparring-Run": run},
        )
        assert response.status_code == 200, response.text

        exported = await review.client.get("/export", params={"run": run}, headers=ADMIN)
        assert exported.status_code == 200, exported.text[:200]
        (line,) = [json.loads(text) for text in exported.text.splitlines()]
        assert line["trace_id"] == trace
        stored = line["grades"][0]["item"]
        assert float(stored["mass_kg"]) == 1e20 and float(stored["atoms"]) == float(2**70)

        await login(review)
        page = await review.client.get(f"/review/rollouts/{trace}")
        assert page.status_code == 200
        assert 'data-field="mass_kg"' in page.text and 'data-field="atoms"' in page.text
