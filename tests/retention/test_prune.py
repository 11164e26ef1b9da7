"""`sparring prune` on both backends: what is old goes with its calls and grades, nothing else does."""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.db.migrate import upgrade
from app.db.models import Grade, KeptState, RemoteRollout, RolloutLabel, RolloutRow, ToolCall, TranscriptRow
from app.db.session import Database, build_sessionmaker
from app.errors import NotFound
from app.remote.repository import RemoteRolloutRepository
from app.remote.service import RemoteRolloutService
from app.retention.repository import RetentionRepository
from app.retention.service import parse_age, prune
from app.review.label_repository import LabelRepository
from app.review.labels import RolloutLabels
from app.review.schemas import LabelIn
from app.rollouts.repository import RolloutRepository
from tests.conftest import create_pg_database, drop_pg_database

NOW = datetime.now(UTC)
# The end of prune's counts when only rollouts, calls and grades went.
NOTHING_ELSE = "0 transcripts, 0 labels, 0 kept states, 0 remote rollouts"


@pytest.fixture(params=["embedded", "real"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path) -> Iterator[str]:
    """A migrated database of its own (prune without --run would touch other tests' rows)."""
    if request.param == "embedded":
        db = tmp_path / "sparring.db"
        db.write_bytes(sqlite_template.read_bytes())
        yield f"sqlite+aiosqlite:///{db}"
        return
    name = f"sparring_prune_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = asyncio.run(create_pg_database(name))
    upgrade(url)
    yield url
    asyncio.run(drop_pg_database(name))


@pytest.fixture(autouse=True)
def _settings(monkeypatch: pytest.MonkeyPatch, database_url: str, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("SPARRING_DATABASE_URL", database_url)
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPARRING_REDIS_URL", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def ago(days: float) -> datetime:
    return NOW - timedelta(days=days)


def rollout(
    trace: str, *, run: str, last_days: float, calls: int, graded_days: float | None = None
) -> list[object]:
    """A rollout row, its calls (all at its last activity) and, if graded, one grade."""
    rows: list[object] = [
        RolloutRow(
            trace_id=trace, run=run, first_seen=ago(last_days), last_seen=ago(last_days),
            graded_at=ago(graded_days) if graded_days is not None else None, calls=calls,
        )
    ]  # fmt: skip
    for n in range(calls):
        rows.append(
            ToolCall(
                trace_id=trace, call_id=f"c{n}", tool="echo", arguments="{}", output="x", outcome="ok",
                status_code=200, started_at=ago(last_days), ended_at=ago(last_days), latency_ms=1.0,
                worker="w", run=run,
            )
        )  # fmt: skip
    if graded_days is not None:
        rows.append(grade(trace, run=run, days=graded_days))
    return rows


def grade(trace: str | None, *, run: str, days: float) -> Grade:
    return Grade(
        trace_id=trace, grader="g", grader_version="v", status="ok", score=1.0, run=run,
        latency_ms=1.0, created_at=ago(days),
    )  # fmt: skip


async def insert(url: str, rows: list[object]) -> None:
    engine = create_async_engine(url)
    try:
        async with build_sessionmaker(engine)() as session, session.begin():
            session.add_all(rows)
    finally:
        await engine.dispose()


async def counts(url: str) -> dict[str, int]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return {
                "rollouts": (await conn.execute(select(func.count()).select_from(RolloutRow))).scalar_one(),
                "calls": (await conn.execute(select(func.count()).select_from(ToolCall))).scalar_one(),
                "grades": (await conn.execute(select(func.count()).select_from(Grade))).scalar_one(),
            }
    finally:
        await engine.dispose()


async def traces_left(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(select(RolloutRow.trace_id).union(select(ToolCall.trace_id)))
            grades = await conn.execute(select(Grade.trace_id))
            return {r[0] for r in rows} | {f"grade:{g[0]}" for g in grades}
    finally:
        await engine.dispose()


def seed(url: str) -> None:
    rows: list[object] = []
    rows += rollout("old-graded", run="r1", last_days=40, calls=3, graded_days=39)
    rows += rollout("old-ungraded", run="r2", last_days=50, calls=2)
    rows += rollout("recent", run="r1", last_days=1, calls=4, graded_days=1)
    # Old calls but a recent grade: the rollout is still in use, it stays whole.
    rows += rollout("regraded", run="r1", last_days=40, calls=2, graded_days=2)
    rows += [grade(None, run="r1", days=45), grade(None, run="r2", days=45), grade(None, run="r1", days=3)]
    asyncio.run(insert(url, rows))


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["prune", *args])
    return result.exit_code, result.stdout, result.stderr


def test_prune_removes_old_rollouts_with_their_calls_and_grades(database_url: str) -> None:
    seed(database_url)
    code, out, _ = invoke("--older-than", "30d")
    assert code == 0, out
    assert re.match(
        rf"removed 2 rollouts, 5 calls, 3 grades, {NOTHING_ELSE} older than \d{{4}}-\d\d-\d\dT",
        out,
    ), out
    assert asyncio.run(traces_left(database_url)) == {
        "recent", "regraded", "grade:recent", "grade:regraded", "grade:None",
    }  # fmt: skip
    assert asyncio.run(counts(database_url)) == {"rollouts": 2, "calls": 6, "grades": 3}
    # Nothing old is left: a second prune removes nothing.
    code, out, _ = invoke("--older-than", "30d")
    assert out.startswith("removed 0 rollouts, 0 calls, 0 grades"), out


def test_dry_run_counts_what_prune_then_removes_and_deletes_nothing(database_url: str) -> None:
    seed(database_url)
    before = asyncio.run(counts(database_url))
    code, out, _ = invoke("--older-than", "30d", "--dry-run")
    assert code == 0, out
    assert out.startswith(f"would remove 2 rollouts, 5 calls, 3 grades, {NOTHING_ELSE} older than"), out
    assert asyncio.run(counts(database_url)) == before
    code, out, _ = invoke("--older-than", "30d")
    assert out.startswith("removed 2 rollouts, 5 calls, 3 grades"), out


def test_run_restricts_the_prune_to_one_run_label(database_url: str) -> None:
    seed(database_url)
    code, out, _ = invoke("--older-than", "30d", "--run", "r2", "--dry-run")
    assert out.startswith(f"would remove 1 rollouts, 2 calls, 1 grades, {NOTHING_ELSE} of run 'r2'"), out
    code, out, _ = invoke("--older-than", "30d", "--run", "r2")
    assert code == 0 and out.startswith(
        f"removed 1 rollouts, 2 calls, 1 grades, {NOTHING_ELSE} of run 'r2'"
    ), out
    left = asyncio.run(traces_left(database_url))
    assert "old-ungraded" not in left and "old-graded" in left


def test_the_age_decides(database_url: str) -> None:
    seed(database_url)
    # 45 days: only the 50-day-old rollout and the 45-day-old traceless grades are older.
    code, out, _ = invoke("--older-than", "46d")
    assert code == 0, out
    assert out.startswith("removed 1 rollouts, 2 calls, 0 grades"), out
    code, out, _ = invoke("--older-than", "6w")  # 42 days
    assert code == 0, out
    assert out.startswith("removed 0 rollouts, 0 calls, 2 grades"), out


def test_prune_works_in_bounded_batches(database_url: str) -> None:
    rows: list[object] = []
    for n in range(23):
        rows += rollout(f"old-{n:02}", run="bulk", last_days=60 + n, calls=2, graded_days=59)
    rows += [grade(None, run="bulk", days=60) for _ in range(9)]
    rows += rollout("keep", run="bulk", last_days=1, calls=1)
    asyncio.run(insert(database_url, rows))
    code, out, err = invoke("--older-than", "30d", "--batch-size", "5")
    assert code == 0, out
    assert out.startswith("removed 23 rollouts, 46 calls, 32 grades"), out
    batches = re.findall(r"removed (\d+) rollouts, (\d+) calls, (\d+) grades", err)
    # 5 batches of rollouts (5+5+5+5+3), then the traceless grades (5, 4): none bigger than asked.
    assert [int(r) for r, _, _ in batches] == [5, 5, 5, 5, 3, 0, 0]
    assert [int(g) for _, _, g in batches] == [5, 5, 5, 5, 3, 5, 4]
    assert asyncio.run(traces_left(database_url)) == {"keep"}


def test_a_rollout_that_comes_back_to_life_during_the_prune_stays_whole(database_url: str) -> None:
    asyncio.run(insert(database_url, rollout("revived", run="r", last_days=40, calls=2)))
    cutoff = NOW - timedelta(days=30)

    async def scenario() -> tuple[int, int]:
        engine = create_async_engine(database_url)
        try:
            sessions = build_sessionmaker(engine)
            async with sessions() as session:
                selected = await RetentionRepository(session).old_trace_ids(cutoff, None, 10)
            assert selected == ["revived"]
            # A call is logged for it between the selection and the delete.
            async with sessions() as session, session.begin():
                await session.execute(
                    update(RolloutRow).where(RolloutRow.trace_id == "revived").values(last_seen=NOW)
                )
            async with sessions() as session, session.begin():
                removed = await RetentionRepository(session).delete_rollouts(selected, cutoff)
            return removed.rollouts, removed.calls
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == (0, 0)
    assert asyncio.run(counts(database_url)) == {"rollouts": 1, "calls": 2, "grades": 0}


@pytest.mark.parametrize("bad", ["30", "thirty days", "0d", "-5d", "3y", "99999999999999d", "1000000d"])
def test_a_bad_age_is_a_usage_error(bad: str) -> None:
    code, _, err = invoke("--older-than", bad)
    assert code == 2
    assert "--older-than" in err


def test_parse_age_units() -> None:
    assert parse_age("30d") == timedelta(days=30)
    assert parse_age("12h") == timedelta(hours=12)
    assert parse_age("90m") == timedelta(minutes=90)
    assert parse_age("2w") == timedelta(weeks=2)
    assert parse_age(" 45S ") == timedelta(seconds=45)


def transcript(trace: str, *, days: float) -> TranscriptRow:
    return TranscriptRow(
        trace_id=trace, model="m", source="test", messages=[{"role": "user", "content": "hi"}],
        size_bytes=20, stored_at=ago(days),
    )  # fmt: skip


async def left(url: str, column: Any) -> set[str]:
    """The values of `column` left in the database (the ids of what a prune kept)."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return {r[0] for r in await conn.execute(select(column))}
    finally:
        await engine.dispose()


async def transcripts_left(url: str) -> set[str]:
    return await left(url, TranscriptRow.trace_id)


def test_a_pruned_rollout_takes_its_conversation_with_it(database_url: str) -> None:
    # The conversation belongs to the rollout alone: left behind, no page or export could reach it, and
    # it would never go.
    rows: list[object] = []
    rows += rollout("old", run="r", last_days=40, calls=2, graded_days=39)
    rows += rollout("recent", run="r", last_days=1, calls=2, graded_days=1)
    rows += [transcript("old", days=39), transcript("recent", days=1)]
    asyncio.run(insert(database_url, rows))
    code, out, _ = invoke("--older-than", "30d")
    assert code == 0 and out.startswith("removed 1 rollouts, 2 calls, 1 grades"), out
    assert asyncio.run(transcripts_left(database_url)) == {"recent"}


def test_what_goes_with_a_rollout_is_counted_and_dry_run_counts_it_too(database_url: str) -> None:
    # Its conversation, its label and its kept state go with a pruned rollout: the operator is told so,
    # before (--dry-run) and after.
    rows: list[object] = []
    rows += rollout("old", run="r", last_days=40, calls=2, graded_days=39)
    rows += rollout("recent", run="r", last_days=1, calls=1, graded_days=1)
    for trace, days in (("old", 39), ("recent", 1)):
        rows += [
            transcript(trace, days=days),
            RolloutLabel(trace_id=trace, label="pass", labelled_by="admin", labelled_at=ago(days)),
            KeptState(trace_id=trace, changes={}, kept_at=ago(days)),
        ]
    asyncio.run(insert(database_url, rows))
    with_it = "1 transcripts, 1 labels, 1 kept states, 0 remote rollouts"
    what = f"1 rollouts, 2 calls, 1 grades, {with_it} older than"
    code, out, _ = invoke("--older-than", "30d", "--dry-run")
    assert code == 0 and out.startswith(f"would remove {what}"), out
    code, out, err = invoke("--older-than", "30d")
    assert code == 0 and out.startswith(f"removed {what}"), out
    # (On Postgres the batch leaves the calls to the day partition it drops.)
    assert re.search(
        rf"removed 1 rollouts, \d calls, 1 grades, {with_it}\n",
        err,
    )
    assert asyncio.run(transcripts_left(database_url)) == {"recent"}


def remote(
    rollout_id: str,
    *,
    status: str,
    run: str | None = "r",
    created: float,
    finished: float | None,
    lease: float,
) -> RemoteRollout:
    """A remote rollout row (`POST /remote/init`), its dates in days ago (a lease may lie ahead: < 0)."""
    return RemoteRollout(
        rollout_id=rollout_id, trace_id=f"trace-{rollout_id}", run=run, model="m", status=status,
        request={"messages": [{"role": "user", "content": "hi"}], "item": {"answer": 42}},
        worker="w", lease_until=ago(lease), created_at=ago(created),
        finished_at=ago(finished) if finished is not None else None,
    )  # fmt: skip


async def remote_left(url: str) -> set[str]:
    return await left(url, RemoteRollout.rollout_id)


def test_old_remote_rollouts_go_by_their_own_dates(database_url: str) -> None:
    # A remote rollout's row keeps its init request (messages, item, parameters): it ages by its end (or,
    # never ended, its start); a running one only once its lease lapsed long ago (its worker is dead).
    asyncio.run(
        insert(
            database_url,
            [
                remote("finished-old", status="finished", created=41, finished=40, lease=41),
                remote("error-old", status="error", created=45, finished=44, lease=45),
                remote("error-unfinished", status="error", created=40, finished=None, lease=40),
                remote("lost-long-ago", status="running", created=50, finished=None, lease=49),
                remote("other-run", status="finished", run="other", created=40, finished=40, lease=40),
                remote("finished-lately", status="finished", created=40, finished=1, lease=1),
                remote("error-recent", status="error", created=2, finished=1, lease=2),
                remote("running", status="running", created=40, finished=None, lease=-1),
                remote("lost-lately", status="running", created=40, finished=None, lease=2),
            ],
        )
    )
    code, out, _ = invoke("--older-than", "30d", "--run", "r", "--dry-run")
    assert code == 0 and re.match(r"would remove 0 rollouts, .*, 4 remote rollouts of run 'r' older", out), (
        out
    )
    code, out, err = invoke("--older-than", "30d", "--run", "r", "--batch-size", "3")
    assert code == 0 and re.match(r"removed 0 rollouts, .*, 4 remote rollouts of run 'r' older", out), out
    assert re.findall(r"(\d+) remote rollouts\n", err) == ["3", "1"], err
    left = {"other-run", "finished-lately", "error-recent", "running", "lost-lately"}
    assert asyncio.run(remote_left(database_url)) == left
    code, out, _ = invoke("--older-than", "30d")
    assert code == 0 and re.match(r"removed 0 rollouts, .*, 1 remote rollouts older", out), out
    assert asyncio.run(remote_left(database_url)) == left - {"other-run"}

    async def status(rollout_id: str) -> str:
        engine = create_async_engine(database_url)
        try:
            service = RemoteRolloutService(
                database=Database(build_sessionmaker(engine), retry_after=1),
                execute=lambda _: asyncio.sleep(0),  # type: ignore[arg-type,return-value]
                worker="w2",
                max_concurrent=1,
                lease_seconds=30,
                retry_after=1,
            )
            try:
                return str((await service.status(rollout_id))["state"])
            except NotFound as exc:
                return exc.message
        finally:
            await engine.dispose()

    # A pruned rollout id reads as one never known; the ones kept read as before.
    assert asyncio.run(status("finished-old")) == "no remote rollout 'finished-old'"
    assert asyncio.run(status("never-was")) == "no remote rollout 'never-was'"
    assert asyncio.run(status("finished-lately")) == "finished"
    assert asyncio.run(status("running")) == "running"


def test_a_lost_remote_rollout_pruned_while_its_status_is_read_is_not_found(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A status read finds the row running on a lapsed lease and marks it lost; the prune deletes it in
    # between: the answer is the 404 of an unknown id, not a 500.
    asyncio.run(insert(database_url, [remote("lost", status="running", created=50, finished=None, lease=49)]))
    fail_lost = RemoteRolloutRepository.fail_lost

    async def pruned_first(self: RemoteRolloutRepository, *args: Any, **kwargs: Any) -> int:
        engine = create_async_engine(database_url, poolclass=NullPool)
        try:
            removed = await prune(engine, older_than=timedelta(days=30))
        finally:
            await engine.dispose()
        assert removed.remote_rollouts == 1
        return await fail_lost(self, *args, **kwargs)

    monkeypatch.setattr(RemoteRolloutRepository, "fail_lost", pruned_first)

    async def status() -> str:
        engine = create_async_engine(database_url, poolclass=NullPool)
        service = RemoteRolloutService(
            database=Database(build_sessionmaker(engine), retry_after=1),
            execute=lambda _: asyncio.sleep(0),  # type: ignore[arg-type,return-value]
            worker="w2",
            max_concurrent=1,
            lease_seconds=30,
            retry_after=1,
        )
        try:
            return str((await service.status("lost"))["state"])
        except NotFound as exc:
            return exc.message
        finally:
            await engine.dispose()

    assert asyncio.run(status()) == "no remote rollout 'lost'"


def test_an_old_conversation_of_no_rollout_goes_by_its_own_date(database_url: str) -> None:
    # `PUT /rollouts/{trace_id}/transcript` needs no call first: a conversation whose trace never logged a
    # call (or whose rollout went before it was stored) has no rollout to go with, and ages by itself.
    # It has no run: only a prune without --run removes it.
    rows: list[object] = []
    rows += rollout("recent", run="r", last_days=1, calls=1)
    rows += [
        transcript("stray-old", days=40),
        transcript("stray-recent", days=1),
        transcript("recent", days=40),  # stored long ago, its rollout is in use: it stays
    ]
    asyncio.run(insert(database_url, rows))
    code, out, _ = invoke("--older-than", "30d", "--run", "r", "--dry-run")
    assert code == 0 and out.startswith(f"would remove 0 rollouts, 0 calls, 0 grades, {NOTHING_ELSE}"), out
    code, out, _ = invoke("--older-than", "30d", "--run", "r")
    assert code == 0 and out.startswith(f"removed 0 rollouts, 0 calls, 0 grades, {NOTHING_ELSE}"), out
    assert asyncio.run(transcripts_left(database_url)) == {"stray-old", "stray-recent", "recent"}
    stray = "0 rollouts, 0 calls, 0 grades, 1 transcripts, 0 labels, 0 kept states, 0 remote rollouts"
    code, out, _ = invoke("--older-than", "30d", "--dry-run")
    assert code == 0 and out.startswith(f"would remove {stray} older than"), out
    code, out, err = invoke("--older-than", "30d")
    assert code == 0 and out.startswith(f"removed {stray} older than"), out
    assert f"removed {stray}\n" in err, err
    assert asyncio.run(transcripts_left(database_url)) == {"stray-recent", "recent"}


def test_a_label_set_while_its_rollout_is_pruned_goes_in_a_later_prune(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A person labels an old rollout while the prune deletes it: the label's check saw the rollout, the
    # prune deleted it (and its labels: none yet), then the label was written, for no rollout. It has no
    # run either: it ages by its own date.
    asyncio.run(insert(database_url, rollout("old", run="r", last_days=40, calls=1, graded_days=40)))
    put = LabelRepository.put

    async def pruned_first(self: LabelRepository, *args: Any, **kwargs: Any) -> None:
        engine = create_async_engine(database_url, poolclass=NullPool)
        try:
            removed = await prune(engine, older_than=timedelta(days=30))
        finally:
            await engine.dispose()
        assert removed.rollouts == 1
        await put(self, *args, **kwargs)

    async def label() -> None:
        engine = create_async_engine(database_url, poolclass=NullPool)
        try:
            async with Database(build_sessionmaker(engine), retry_after=1).session(write=True) as session:
                await RolloutLabels(session).put("old", LabelIn(label="fail"), by="admin")
        finally:
            await engine.dispose()

    async def labels_left() -> set[str]:
        return await left(database_url, RolloutLabel.trace_id)

    monkeypatch.setattr(LabelRepository, "put", pruned_first)
    asyncio.run(label())
    monkeypatch.setattr(LabelRepository, "put", put)
    assert asyncio.run(labels_left()) == {"old"}
    assert asyncio.run(counts(database_url))["rollouts"] == 0
    code, out, _ = invoke("--older-than", "1h", "--dry-run")
    assert code == 0 and out.startswith(f"would remove 0 rollouts, 0 calls, 0 grades, {NOTHING_ELSE}"), out
    time.sleep(1.1)
    stray = "0 rollouts, 0 calls, 0 grades, 0 transcripts, 1 labels, 0 kept states, 0 remote rollouts"
    code, out, _ = invoke("--older-than", "1s", "--dry-run")
    assert code == 0 and out.startswith(f"would remove {stray}"), out
    code, out, _ = invoke("--older-than", "1s")
    assert code == 0 and out.startswith(f"removed {stray}"), out
    assert asyncio.run(labels_left()) == set()


async def test_graded_at_is_the_newest_grade_whichever_commits_last(database_url: str) -> None:
    """Two grades of a rollout committing out of order: graded_at keeps the newer. Set to the one that
    committed last, it made the rollout old while a newer grade was not, and the prune left that grade
    behind with no rollout."""
    await insert(database_url, rollout("t-order", run="r", last_days=40, calls=1))
    await insert(database_url, [grade("t-order", run="r", days=1), grade("t-order", run="r", days=35)])
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        for days in (1, 35):  # the newer grade commits first
            async with build_sessionmaker(engine)() as session, session.begin():
                await RolloutRepository(session).mark_graded("t-order", at=ago(days), run="r")
        async with build_sessionmaker(engine)() as session:
            row = await RolloutRepository(session).get("t-order")
        assert row is not None and row.graded_at == ago(1)
        removed = await prune(engine, older_than=timedelta(days=30))
    finally:
        await engine.dispose()
    assert removed.rollouts == 0 and (await counts(database_url))["grades"] == 2
