"""The review pages laid out in real Chromium at 1280 and 1920 px: nothing wider than the window, the
rollout list's flags column on screen, the conversation, the runs page's lines and canary groups, and
compare's interval visible. Screenshots go to test-artifacts/review/ (git-ignored)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from app.db.session import build_engine, build_sessionmaker
from app.review.seed import SeedSpec, seed_run
from tests.conftest import ADMIN_KEY, GRADER_KEY, TOOLS_KEY, call_body, new_trace
from tests.review.conftest import grade_rollout
from tests.review.test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, data, live_server  # noqa: F401

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)
WIDTHS = (1280, 1920)
LONG_ANSWER = "The order was returned and refunded to the original card; " * 6


@pytest.fixture
async def layout_data(data: dict[str, str], live_server: tuple[str, str]) -> AsyncIterator[dict[str, str]]:  # noqa: F811
    """The live run's parallel rollout with its conversation, and a canary's runs beside the baseline."""
    base, url = live_server
    engine = build_engine(url)
    label = "canary-20261205-layout"
    for seed, policy in ((3, "empty"), (4, "gold")):
        await seed_run(
            engine, replace(SeedSpec(rollouts=12, items=4, max_calls=3), run=f"{label}-{policy}", seed=seed)
        )
    # A rollout with a long run label, a long item key and many flags: the widest row a list shows.
    wide = new_trace()
    long_run = "grpo-qwen3-8b-retail-" + "lr3e-6-kl0.02-" * 4
    item = {"id": "retail-task-" + "0123456789" * 8}
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOOLS_KEY}"}) as client:
        body = call_body({"text": "x"}, trace_id=wide, call_id="w0", item=item)
        answered = await client.post("/tools/echo", json=body, headers={"X-Sparring-Run": long_run})
        assert answered.status_code == 200, answered.text
    flags = [{"name": f"grader_flag_number_{i}", "reason": "raised by the grader"} for i in range(5)]
    await grade_rollout(
        build_sessionmaker(engine), wide, answer="x", score=0.2, run=long_run, item=item, grader_flags=flags
    )
    await engine.dispose()
    calls = [("e0", "echo", '{"text": "<b>not bold</b> order 7731"}')] + [
        (f"s{i}", "slow", f'{{"seconds": {0.3 + i / 100}}}') for i in range(3)
    ]
    conversation = {
        "model": "policy-7b",
        "source": "eval",
        "messages": [
            {"role": "system", "content": "You are a support agent. " * 20},
            {"role": "user", "content": "Where is order 7731?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "reasoning": "Echo first, then wait on three slow lookups in parallel.",
                "tool_calls": [{"call_id": c, "name": n, "arguments": a} for c, n, a in calls],
            },
            {"role": "simulated_user", "content": "Any news? " + "x" * 300},
            {"role": "assistant", "content": LONG_ANSWER},
        ],
    }
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {GRADER_KEY}"}) as client:
        stored = await client.put(f"/rollouts/{data['parallel']}/transcript", json=conversation)
        assert stored.status_code == 200, stored.text
    yield {**data, "canary": label, "wide": wide, "long_run": long_run}


async def _fits(page: Any, width: int) -> None:
    """Nothing on the page is wider than the window (no horizontal scroll of the page itself)."""
    scroll = await page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"{page.url}: the page is {scroll} px wide in a {width} px window"


async def _on_screen(locator: Any, width: int) -> None:
    box = await locator.bounding_box()
    assert box is not None and box["width"] > 0 and box["height"] > 0, "not rendered"
    assert box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5, f"cut off: {box} in {width} px"


@pytest.mark.parametrize("width", WIDTHS)
async def test_pages_fit_1280_and_1920_pixels(layout_data: dict[str, str], width: int) -> None:
    from playwright.async_api import async_playwright

    base, d = layout_data["base"], layout_data
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = await browser.new_page(viewport={"width": width, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        await page.goto(f"{base}/review/login")
        await page.fill("input[name=key]", ADMIN_KEY)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{base}/review")

        # The rollout list: the flags column and the score bars are on screen, the widest row included.
        await page.goto(f"{base}/review")
        await _fits(page, width)
        await _on_screen(page.locator("table.rollouts th").last, width)
        await _on_screen(page.locator(f"tr[data-trace='{d['wide']}'] td").last, width)
        await page.goto(f"{base}/review?run={d['run']}")
        await _fits(page, width)
        flagged = page.locator(f"tr[data-trace='{d['looping']}'] td.flags-cell a.flag")
        await _on_screen(flagged, width)
        await _on_screen(page.locator("tr.rollout-row svg.score-bar").first, width)
        await page.screenshot(path=str(ARTIFACTS / f"layout-{width}-rollouts.png"), full_page=True)

        # The rollout: the conversation's turns, the calls inside the assistant's turn, the reasoning.
        await page.goto(f"{base}/review/rollouts/{d['parallel']}")
        await _fits(page, width)
        turns = page.locator("#conversation ~ .conversation .turn")
        assert await turns.count() == 5
        assistant = page.locator(".turn[data-role=assistant]").first
        assert await assistant.locator("article.call").count() == 4
        await _on_screen(assistant.locator("article.call").last, width)
        assert (
            "simulated user"
            in (await page.locator(".turn[data-role=simulated_user] .role").inner_text()).lower()
        )
        assert "#4 crash" in await page.locator("#unmatched-calls").inner_text()
        for index in range(await turns.count()):
            await _on_screen(turns.nth(index), width)
        await page.screenshot(path=str(ARTIFACTS / f"layout-{width}-rollout.png"), full_page=True)

        # Runs: reward lines, the canary's runs under their label.
        await page.goto(f"{base}/review/runs")
        await _fits(page, width)
        group = page.locator(f"tr.canary-group[data-canary='{d['canary']}']")
        await _on_screen(group, width)
        assert await page.locator("tr.canary-member").count() == 2
        await _on_screen(page.locator("tr[data-run=baseline] td.spark svg"), width)
        await _on_screen(page.locator("table.runs th").last, width)
        await page.screenshot(path=str(ARTIFACTS / f"layout-{width}-runs.png"), full_page=True)

        # Compare: the interval and the scatter.
        await page.goto(f"{base}/review/compare?a=baseline&b={d['canary']}-gold")
        await _fits(page, width)
        await _on_screen(page.locator("#reward-ci"), width)
        await _on_screen(page.locator("svg[data-chart=item-pairs]"), width)
        await page.screenshot(path=str(ARTIFACTS / f"layout-{width}-compare.png"), full_page=True)

        for path in ("/review/flags", "/review/run?name=baseline"):
            await page.goto(f"{base}{path}")
            await _fits(page, width)
        await browser.close()
    assert errors == []
    for name in ("rollouts", "rollout", "runs", "compare"):
        assert (ARTIFACTS / f"layout-{width}-{name}.png").stat().st_size > 5_000
