"""The review UI end to end in real Chromium (Debian's package, driven by Playwright), on a real server."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.session import build_engine, build_sessionmaker
from app.grading.flags import FLAG_NAMES
from app.main import create_app
from app.review.seed import SeedSpec, seed_run
from tests.conftest import ADMIN_KEY, GRADER_KEY, TOOLS_KEY, call_body, make_settings, new_trace
from tests.review.conftest import PACKS, grade_rollout
from tests.review.test_item_view import GRADERS
from tests.review.test_item_view import item as review_item
from tests.review.test_item_view import sample as item_sample

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine


@pytest.fixture
def live_server(tmp_path: Path, sqlite_template: Path) -> Iterator[tuple[str, str]]:
    """uvicorn in a thread on a free loopback port, embedded backend (SQLite file + in-memory state)."""
    db = tmp_path / "sparring.db"
    db.write_bytes(sqlite_template.read_bytes())
    url = f"sqlite+aiosqlite:///{db}"
    graders = tmp_path / "graders.yaml"
    graders.write_text(yaml.safe_dump(GRADERS))
    settings = make_settings(tmp_path / "home", database_url=url, redis_url=None, graders_file=graders)
    app = create_app(settings, packs=PACKS)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="review-live-server", daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.025)
    assert server.started, "the server did not start"
    yield f"http://127.0.0.1:{port}", url
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
async def data(live_server: tuple[str, str]) -> AsyncIterator[dict[str, str]]:
    """A seeded run with known items, and a live run whose rollouts went through the real tool routes."""
    base, url = live_server
    engine = build_engine(url)
    baseline = replace(SeedSpec(rollouts=60, items=6, max_calls=8), run="baseline")
    await seed_run(engine, baseline)
    run = f"live-{uuid.uuid4().hex[:6]}"
    looping, parallel, clean = new_trace(), new_trace(), new_trace()
    headers = {"Authorization": f"Bearer {TOOLS_KEY}", "X-Sparring-Run": run}
    async with httpx.AsyncClient(base_url=base, headers=headers) as client:

        async def call(tool: str, args: object, trace: str, call_id: str) -> None:
            r = await client.post(f"/tools/{tool}", json=call_body(args, trace_id=trace, call_id=call_id))
            assert r.status_code in (200, 500), r.text

        for i in range(3):
            await call("read_counter", {}, looping, f"r{i}")
        await call("echo", {"text": "<b>not bold</b> order 7731"}, parallel, "e0")
        await asyncio.gather(*(call("slow", {"seconds": 0.3 + i / 100}, parallel, f"s{i}") for i in range(3)))
        await call("crash", {}, parallel, "c0")
        await call("read_counter", {}, clean, "r0")
    sessions = build_sessionmaker(engine)
    await grade_rollout(sessions, looping, answer="The counter is at 100.", score=1.0, run=run)
    await grade_rollout(
        sessions, parallel, answer="Order 7731 is done.", score=0.4, run=run, sub_scores={"tone": 0.5}
    )
    await grade_rollout(sessions, clean, answer="The counter is at 100.", score=1.0, run=run)
    await engine.dispose()
    yield {"base": base, "run": run, "looping": looping, "parallel": parallel, "clean": clean}


async def test_review_ui_in_chromium(data: dict[str, str], tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    base = data["base"]
    shots = tmp_path / "screenshots"
    shots.mkdir()
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on(
            "console", lambda m: errors.append(f"{m.text} at {m.location}") if m.type == "error" else None
        )

        # Not logged in: the login form; a wrong key is refused.
        await page.goto(f"{base}/review")
        assert page.url.startswith(f"{base}/review/login")
        await page.fill("input[name=key]", TOOLS_KEY)
        await page.click("button[type=submit]")
        assert await page.locator("p.error").inner_text() == "That is not an admin key."
        await page.screenshot(path=str(shots / "login-refused.png"))

        await page.fill("input[name=key]", ADMIN_KEY)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{base}/review")
        cookies = await page.context.cookies()
        (session,) = [c for c in cookies if c["name"] == "sparring_review"]
        assert session["httpOnly"] and session["sameSite"] == "Strict" and ADMIN_KEY not in session["value"]
        assert await page.locator("tr.rollout-row").count() == 50  # first page of 63

        # Filter: the live run, then only its loops.
        await page.select_option("select[name=run]", data["run"])
        async with page.expect_navigation():
            await page.click("form.filters button[type=submit]")
        rows = page.locator("tr.rollout-row")
        assert await rows.count() == 3
        await page.select_option("select[name=flag]", "repeated_call")
        async with page.expect_navigation():
            await page.click("form.filters button[type=submit]")
        assert await rows.count() == 1
        assert await rows.first.get_attribute("data-trace") == data["looping"]
        await page.screenshot(path=str(shots / "rollouts-filtered.png"), full_page=True)

        # A rollout with parallel calls, a crash and escaped output.
        await page.goto(f"{base}/review?run={data['run']}")
        await page.click(f"a:text('{data['parallel']}')")
        await page.wait_for_url(f"**/review/rollouts/{data['parallel']}")
        assert await page.locator("#call-count").inner_text() == "5"
        assert await page.locator("article.call").count() == 5
        assert await page.locator("section.batch").count() == 3
        parallel_batch = page.locator("section.batch.parallel")
        assert await parallel_batch.count() == 1
        assert await parallel_batch.locator("article.call").count() == 3
        assert "3 parallel calls" in await parallel_batch.inner_text()
        assert await page.locator("article.call.outcome-tool_crash").count() == 1
        assert await page.locator("li.flag-item[data-flag=tool_errors]").count() == 1
        assert await page.locator("article.call.flagged").count() == 1
        assert await page.locator("pre.output b").count() == 0  # tool output is text, never markup
        assert "<b>not bold</b> order 7731" in await page.locator("#call-0 pre.output").inner_text()
        assert "tone" in await page.locator("table.sub-scores").inner_text()
        await page.screenshot(path=str(shots / "rollout.png"), full_page=True)

        # The looping rollout shows its flag and the evidence calls.
        await page.goto(f"{base}/review/rollouts/{data['looping']}")
        flag = page.locator("li.flag-item[data-flag=repeated_call]")
        assert "read_counter ×3" in await flag.inner_text()
        assert await flag.locator(".evidence a").count() == 3
        assert await page.locator("article.call.flagged").count() == 3

        # The run page's charts are drawn server-side as SVG.
        await page.goto(f"{base}/review/run?name=baseline")
        assert await page.locator("#stat-rollouts").inner_text() == "60"
        assert await page.locator("#stat-reward").inner_text() == "0.5"
        assert await page.locator("#stat-no-signal").inner_text() == "66.7%"
        assert await page.locator("svg[data-chart=reward] rect.bar").count() == 10
        calls_bars = await page.locator("svg[data-chart=calls-per-rollout] rect.bar").count()
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as api:
            stats = (await api.get("/review/api/stats", params={"run": "baseline"})).json()
        assert (
            calls_bars
            == len(stats["calls_per_rollout_histogram"]["counts"])
            == stats["calls_per_rollout"]["max"] + 1
        )
        assert await page.locator("svg[data-chart=tool-latency] rect.bar").count() == 3 * len(stats["tools"])
        assert await page.locator("svg[data-chart=item-variance] rect.bar").count() == 6
        assert await page.locator("svg[data-chart=item-variance] rect.always-zero").count() == 2
        assert await page.locator("svg[data-chart=item-variance] rect.always-one").count() == 2
        assert await page.locator("svg[data-chart=item-variance] line.whisker").count() == 2
        box = await page.locator("svg[data-chart=reward]").bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 100  # rendered, not collapsed
        await page.screenshot(path=str(shots / "run.png"), full_page=True)

        # Flags page: counts per flag for the live run, and the flagged rollouts.
        await page.goto(f"{base}/review/flags?run={data['run']}")
        assert await page.locator("tr.flag-count").count() == 2
        async with page.expect_navigation():
            await page.click("tr.flag-count[data-flag=tool_errors] a")
        assert await page.locator("tr.rollout-row").count() == 1
        await page.screenshot(path=str(shots / "flags.png"), full_page=True)

        # Log out: back to the login form, and the pages are closed again.
        await page.click("form.logout button")
        await page.wait_for_url(f"{base}/review/login")
        await page.goto(f"{base}/review/runs")
        assert "/review/login" in page.url
        # No CSP violation, no failed asset: the only error is the refused login's own 401.
        assert [e for e in errors if "status of 401" not in e] == []
        assert len(errors) == 1
        await browser.close()

    for name in ("login-refused", "rollouts-filtered", "rollout", "run", "flags"):
        shot = shots / f"{name}.png"
        assert shot.stat().st_size > 5_000, name


ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "review"  # git-ignored


@pytest.fixture
async def team_data(data: dict[str, str]) -> AsyncIterator[dict[str, str]]:
    """Adds a learning run to compare with the baseline, and rollouts graded through POST /grade/exact."""
    base = data["base"]
    async with httpx.AsyncClient(base_url=base) as client:
        run = data["run"]
        routed = new_trace()
        tools = {"Authorization": f"Bearer {TOOLS_KEY}", "X-Sparring-Run": run}
        r = await client.post(
            "/tools/echo", json=call_body({"text": "7"}, trace_id=routed, call_id="e1"), headers=tools
        )
        assert r.status_code == 200, r.text
        grader = {"Authorization": f"Bearer {GRADER_KEY}", "X-Sparring-Run": run}
        for trace, answer in ((data["clean"], "Order 7 shipped"), (routed, "Order 7 is lost somewhere")):
            body = {"sample": item_sample(answer), "item": review_item(7), "trace_id": trace}
            r = await client.post("/grade/exact", json=body, headers=grader)
            assert r.status_code == 200, r.text
    yield {**data, "routed": routed}


async def test_review_pages_a_training_team_lives_in(
    team_data: dict[str, str], live_server: tuple[str, str]
) -> None:
    from playwright.async_api import async_playwright

    base, url = live_server
    engine = build_engine(url)
    tuned = replace(SeedSpec(rollouts=240, items=12, max_calls=8), run="tuned", seed=8, scores="learning")
    await seed_run(engine, tuned)
    await engine.dispose()
    data = team_data
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    api = httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"})

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

        await page.goto(f"{base}/")  # the root leads to the review, through the login
        assert page.url.startswith(f"{base}/review/login")
        await page.screenshot(path=str(ARTIFACTS / "login.png"))
        await page.fill("input[name=key]", ADMIN_KEY)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{base}/review")

        # Totals: the list says how many match, as the API counts them.
        everything = (await api.get("/review/api/rollouts", params={"count": "true", "limit": 1})).json()
        assert int(await page.locator("#total").get_attribute("data-total") or -1) == everything["total"]
        assert f"{everything['total']:,} rollouts match" in await page.locator("#total").inner_text()

        # Search by a fragment of an answer; the query is in the URL, so the search can be shared.
        await page.fill("input[type=search][name=q]", "7731 is")
        async with page.expect_navigation():
            await page.click("form.filters button[type=submit]")
        assert "q=7731+is" in page.url
        rows = page.locator("tr.rollout-row")
        assert await rows.count() == 1 and await rows.first.get_attribute("data-trace") == data["parallel"]
        assert await page.locator("#total").get_attribute("data-total") == "1"
        await page.screenshot(path=str(ARTIFACTS / "rollouts-search.png"), full_page=True)

        # Sorted by score, lowest first, in one run: the totals still match the API's.
        await page.goto(f"{base}/review?run=baseline&sort=score&order=asc")
        scores = [
            float(t) for t in await page.locator("tr.rollout-row td.num:nth-child(9)").all_inner_texts()
        ]
        assert scores == sorted(scores) and len(scores) == 50 and scores[0] == 0
        listed = (await api.get("/review/api/rollouts", params={"run": "baseline", "count": "true"})).json()
        assert await page.locator("#total").get_attribute("data-total") == str(listed["total"]) == "60"
        await page.screenshot(path=str(ARTIFACTS / "rollouts-sorted.png"), full_page=True)

        # The item beside the rollout, and the item's other rollouts.
        await page.goto(f"{base}/review/rollouts/{data['routed']}")
        row = page.locator("#dataset-row")
        assert "What is the status of order 7?" in await row.inner_text()
        assert await row.locator("[data-field=reference_answer]").count() == 1
        assert "Order 7 is lost somewhere" in await page.locator("#graded-sample pre.answer").inner_text()
        assert await page.locator("#item-mean").inner_text() == "0.5"  # one right, one wrong
        await page.screenshot(path=str(ARTIFACTS / "rollout-item.png"), full_page=True)
        async with page.expect_navigation():
            await page.click("#item-key a.item-link")
        assert {await r.get_attribute("data-trace") for r in await rows.all()} == {
            data["clean"],
            data["routed"],
        }
        assert await page.locator("#item-variance").inner_text() == "0.25"

        # Which grader: the live run has two; the selector changes the figures to the API's.
        await page.goto(f"{base}/review/run?name={data['run']}")
        assert "2 graders graded these rollouts" in await page.locator("#grader-note").inner_text()
        for name in ("exact", "test"):
            await page.select_option("select[name=grader]", name)
            async with page.expect_navigation():
                await page.click("form.filters button[type=submit]")
            stats = (await api.get("/review/api/stats", params={"run": data["run"], "grader": name})).json()
            assert await page.locator("#stat-reward").inner_text() == f"{stats['reward']['mean']:.3g}"
            assert f"({name})" in await page.locator("#reward-grader").inner_text()
            assert await page.locator(".grader-name").first.inner_text() == name
        assert (
            stats["reward"]["mean"]
            != (await api.get("/review/api/stats", params={"run": data["run"], "grader": "exact"})).json()[
                "reward"
            ]["mean"]
        )
        await page.screenshot(path=str(ARTIFACTS / "run-grader.png"), full_page=True)

        # The learning curve: one point per window, on either axis.
        for axis in ("time", "order"):
            await page.goto(f"{base}/review/run?name=tuned&axis={axis}")
            curve = (await api.get("/review/api/curve", params={"run": "tuned", "axis": axis})).json()
            points = page.locator("svg[data-chart=reward-curve] circle.point")
            assert await points.count() == len(curve["windows"]) == 20
            box = await page.locator("svg[data-chart=reward-curve]").bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 100
        await page.locator("#over-time").scroll_into_view_if_needed()
        await page.screenshot(path=str(ARTIFACTS / "run-curve.png"), full_page=True)

        # Flags explained: a legend, titles on the badges, and badges are links.
        await page.goto(f"{base}/review/flags?run={data['run']}")
        assert await page.locator("#flag-legend dt").count() == len(FLAG_NAMES) + 1
        badge = page.locator("#flag-legend a.flag").first
        assert (await badge.get_attribute("title") or "").strip() and "flag=" in (
            await badge.get_attribute("href") or ""
        )
        await page.screenshot(path=str(ARTIFACTS / "flags.png"), full_page=True)

        # Compare the baseline with the learning run.
        await page.goto(f"{base}/review/compare?a=baseline&b=tuned")
        deltas = await page.locator("tr.compare-row td.delta").all_inner_texts()
        assert len(deltas) == 11 and all(d and d[0] in "+−0" for d in deltas), deltas
        assert await page.locator("svg[data-chart=reward-a] rect.bar").count() == 10
        assert await page.locator("svg[data-chart=item-pairs] circle.pair").count() == 6
        await page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)

        await page.goto(f"{base}/review/runs")
        await page.screenshot(path=str(ARTIFACTS / "runs.png"), full_page=True)
        await browser.close()
    await api.aclose()

    foreign = [u for u in requests if not (u.startswith(f"{base}/") or u.startswith("data:"))]
    assert foreign == [] and len(requests) > 10
    assert errors == []
    for shot in ARTIFACTS.glob("*.png"):
        assert shot.stat().st_size > 5_000, shot.name


async def test_labelling_a_run_from_its_queue(data: dict[str, str]) -> None:
    """The queue's rollouts labelled on their pages, each label opening the queue's next rollout; the
    buttons carry the access keys (p, f, n) that are the pages' keyboard shortcuts (no script runs)."""
    from playwright.async_api import async_playwright

    base = data["base"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    api = httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await page.goto(f"{base}/review/login")
        await page.fill("input[name=key]", ADMIN_KEY)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{base}/review")

        await page.goto(f"{base}/review/runs/baseline/queue")
        await page.screenshot(path=str(ARTIFACTS / "queue.png"), full_page=True)
        async with page.expect_navigation():
            await page.click("#queue-start")
        first = page.url.split("/review/rollouts/")[1].split("?")[0]
        assert await page.get_attribute("button[value=pass]", "accesskey") == "p"
        assert await page.get_attribute("button[value=fail]", "accesskey") == "f"
        async with page.expect_navigation():
            await page.click("button[value=pass]")
        second = page.url.split("/review/rollouts/")[1].split("?")[0]
        assert second != first and "queue=baseline" in page.url
        await page.fill("input[name=note]", "answer made up")
        async with page.expect_navigation():
            await page.click("button[value=fail]")
        await page.screenshot(path=str(ARTIFACTS / "labelling.png"), full_page=True)
        for name in ("graders", "audit"):
            await page.goto(f"{base}/review/runs/baseline/{name}")
            await page.screenshot(path=str(ARTIFACTS / f"run-{name}.png"), full_page=True)
        await browser.close()
    labels = [(await api.get(f"/review/api/rollouts/{t}/label")).json() for t in (first, second)]
    assert [(x["label"], x["note"], x["labelled_by"]) for x in labels] == [
        ("pass", None, "session"),
        ("fail", "answer made up", "session"),
    ]
    queue = (await api.get("/review/api/runs/baseline/queue")).json()
    assert (queue["labelled"], queue["unlabelled"]) == (2, 58)
    await api.aclose()
