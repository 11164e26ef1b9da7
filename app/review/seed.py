"""Synthetic graded rollouts, bulk-inserted (COPY on Postgres): for benchmarks, demos and tests.

With `scores="known"` (the default) items have known answers: item i is always 0 (i % 3 == 0),
always 1 (i % 3 == 1) or mixed (i % 3 == 2: its rollouts alternate 0 and 1), so the per-item
statistics can be checked exactly. With `scores="learning"` (the demo) the seed decides each
item's kind and difficulty, and the chance of success of the learnable items rises over the run
by `learning`: two seeds give two different runs, and the learning curve goes up.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import Table, insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.models import Grade, RolloutRow, ToolCall
from app.grading.flags import compute_flags
from app.grading.recording import grade_row
from app.rollouts.shapes import RolloutCall

DEFAULT_TOOLS = ("search", "get_order", "get_user", "update_order", "calculate")


@dataclass(frozen=True)
class SeedSpec:
    run: str = "seed"
    rollouts: int = 100
    items: int = 30
    min_calls: int = 2
    max_calls: int = 18
    tools: Sequence[str] = DEFAULT_TOOLS
    parallel_share: float = 0.3  # chance that a call overlaps the previous one (same parallel batch)
    model_error_share: float = 0.05
    crash_share: float = 0.002
    loop_share: float = 0.1  # share of rollouts that repeat one call (raises repeated_call)
    grader: str = "seed"
    start: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=UTC))
    seed: int = 7
    trace_prefix: str = "seed"
    chunk: int = 5000  # rows per INSERT / COPY
    scores: str = "known"  # known | learning (see the module's docstring)
    learning: float = 0.3  # learning: added to a learnable item's chance of success by the run's end


@dataclass(frozen=True)
class SeedResult:
    run: str
    rollouts: int
    calls: int
    grades: int
    items_always_zero: int
    items_always_one: int
    items_mixed: int


def item_kind(index: int) -> str:
    return ("zero", "one", "mixed")[index % 3]


def learning_items(spec: SeedSpec) -> list[tuple[str, float]]:
    """Per item, from the seed: its kind (zero, one or mixed) and a mixed item's starting chance."""
    rng = random.Random(f"items-{spec.seed}")
    out = []
    for _ in range(spec.items):
        roll = rng.random()
        kind = "zero" if roll < 0.2 else "one" if roll < 0.35 else "mixed"
        out.append((kind, rng.uniform(0.1, 0.7)))
    return out


def item_score(item_index: int, repetition: int) -> float:
    kind = item_kind(item_index)
    if kind == "zero":
        return 0.0
    if kind == "one":
        return 1.0
    return float(repetition % 2)


async def _copy(conn: AsyncConnection, table: Table, rows: list[dict[str, Any]]) -> None:
    raw = await conn.get_raw_connection()
    columns = list(rows[0])
    records = [tuple(row[c] for c in columns) for row in rows]
    await raw.driver_connection.copy_records_to_table(table.name, records=records, columns=columns)  # type: ignore[union-attr]


async def bulk_insert(conn: AsyncConnection, table: Table, rows: list[dict[str, Any]], chunk: int) -> None:
    """Insert plain rows fast: COPY on Postgres, multi-row INSERTs elsewhere."""
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        if not part:
            continue
        if conn.dialect.name == "postgresql":
            await _copy(conn, table, part)
        else:
            await conn.execute(insert(table), part)


def _json_rows(rows: list[dict[str, Any]], columns: Sequence[str], *, as_text: bool) -> list[dict[str, Any]]:
    # COPY takes JSONB as text; SQLAlchemy's JSON type serializes the objects itself.
    if not as_text:
        return rows
    for row in rows:
        for column in columns:
            row[column] = orjson.dumps(row[column]).decode()
    return rows


def _seeded_call(
    spec: SeedSpec, rng: random.Random, trace: _SeededTrace, seq: int, moment: datetime, batch_end: datetime
) -> dict[str, Any]:
    """One call of a seeded rollout: started with the previous call (same parallel batch) or after it."""
    tool = spec.tools[0] if trace.looping else spec.tools[rng.randrange(len(spec.tools))]
    if seq and rng.random() < spec.parallel_share:
        began = moment  # overlaps the previous call: same parallel batch
    else:
        began = batch_end + timedelta(milliseconds=rng.randint(50, 400))
    latency = rng.lognormvariate(3.0, 0.8) * (3 if tool == "search" else 1)
    outcome, output, error, status = _seeded_answer(spec, rng, trace.item_index, seq, tool)
    arguments = orjson.dumps({"id": f"{trace.item_index}-{0 if trace.looping else seq % 7}"}).decode()
    return {
        "attempt_id": hashlib.blake2b(f"{trace.trace_id}/{seq}".encode(), digest_size=16).hexdigest(),
        "trace_id": trace.trace_id,
        "call_id": f"call_{seq}",
        "request_id": None,
        "tool": tool,
        "arguments": arguments,
        "output": output,
        "output_bytes": len(output.encode()) if output is not None else 0,
        "outcome": outcome,
        "error": error,
        "status_code": status,
        "started_at": began,
        "ended_at": began + timedelta(milliseconds=latency),
        "latency_ms": latency,
        "worker": "seed",
        "run": spec.run,
        "item_key": trace.item_key,
    }


def _seeded_answer(
    spec: SeedSpec, rng: random.Random, item_index: int, seq: int, tool: str
) -> tuple[str, str | None, str | None, int]:
    """(outcome, output, error, status) of a seeded call: mostly ok, sometimes a model error or a crash."""
    roll = rng.random()
    if roll < spec.crash_share:
        return "tool_crash", None, f"tool {tool!r} crashed: RuntimeError", 500
    if roll < spec.crash_share + spec.model_error_share:
        output = f"Error: no record {seq} for {tool}"
        return "model_error", output, output, 200
    output = orjson.dumps(
        {
            "id": f"{item_index}-{seq}",
            "total": round(rng.uniform(1, 500), 2),
            "note": "x" * rng.randint(20, 600),
        }
    ).decode()
    return "ok", output, None, 200


@dataclass(frozen=True)
class _SeededTrace:
    trace_id: str
    item_index: int
    item_key: str
    looping: bool  # repeats one call (raises repeated_call)


def _seeded_calls(
    spec: SeedSpec, rng: random.Random, trace: _SeededTrace, start: datetime
) -> tuple[list[dict[str, Any]], datetime]:
    """A rollout's calls in start order, and when its last call ended."""
    calls: list[dict[str, Any]] = []
    moment = batch_end = start
    for seq in range(rng.randint(spec.min_calls, spec.max_calls)):
        call = _seeded_call(spec, rng, trace, seq, moment, batch_end)
        moment, batch_end = call["started_at"], max(batch_end, call["ended_at"])
        calls.append(call)
    return calls, batch_end


def _seeded_score(
    spec: SeedSpec, rng: random.Random, learnable: list[tuple[str, float]] | None, r: int
) -> float:
    """The score of the r-th rollout: known per item, or (learning) rising over the run."""
    item_index = r % spec.items
    if learnable is None:
        return item_score(item_index, r // spec.items)
    kind, chance = learnable[item_index]
    chance = min(1.0, chance + spec.learning * r / spec.rollouts)
    return {"zero": 0.0, "one": 1.0}.get(kind, float(rng.random() < chance))


def generate(spec: SeedSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of rollouts, tool_calls and grades (dicts keyed by column name), deterministic in spec.seed."""
    rng = random.Random(spec.seed)
    learnable = learning_items(spec) if spec.scores == "learning" else None
    rollouts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    grades: list[dict[str, Any]] = []
    for r in range(spec.rollouts):
        item_index, repetition = r % spec.items, r // spec.items
        trace = _SeededTrace(
            trace_id=f"{spec.trace_prefix}_{spec.run}_{r:07d}",
            item_index=item_index,
            item_key=f"id:item-{item_index:05d}",
            looping=rng.random() < spec.loop_share,
        )
        start = spec.start + timedelta(seconds=r * 3)
        made, batch_end = _seeded_calls(spec, rng, trace, start)
        calls.extend(made)
        last_seen = max(batch_end, start)
        rollouts.append(
            {
                "trace_id": trace.trace_id,
                "run": spec.run,
                "item_key": trace.item_key,
                "channel": "rft",  # synthetic training rollouts
                "first_seen": start,
                "last_seen": last_seen,
                "graded_at": last_seen + timedelta(seconds=1),
                "calls": len(made),
            }
        )
        score = _seeded_score(spec, rng, learnable, r)
        answer = f"The answer for item {item_index} is {item_index}-{repetition % 3}."
        grades.append(_seeded_grade(spec, rng, trace, made, answer, score, last_seen + timedelta(seconds=1)))
    return rollouts, calls, grades


def _seeded_grade(
    spec: SeedSpec,
    rng: random.Random,
    trace: _SeededTrace,
    calls: list[dict[str, Any]],
    answer: str,
    score: float,
    at: datetime,
) -> dict[str, Any]:
    # Unvalidated: these rows were just built here, and a big seed makes millions of them.
    logged = [RolloutCall.model_construct(seq=seq, batch=0, **call) for seq, call in enumerate(calls)]
    flags = compute_flags(logged, answer=answer, score=score, status="ok")
    return grade_row(
        trace_id=trace.trace_id,
        grader=spec.grader,
        grader_version="1",
        status="ok",
        score=score,
        sub_scores={"correct": score},
        flags=[f.as_json() for f in flags],
        errors=[],
        sample={"output_text": answer},
        item={"id": f"item-{trace.item_index:05d}"},
        run=spec.run,
        latency_ms=rng.uniform(1, 30),
        created_at=at,
    )


async def seed_run(engine: AsyncEngine, spec: SeedSpec) -> SeedResult:
    """Insert spec.rollouts graded rollouts with their calls in one transaction."""
    rollouts, calls, grades = generate(spec)
    async with engine.begin() as conn:
        pg = conn.dialect.name == "postgresql"
        grade_rows = _json_rows(grades, ("sub_scores", "flags", "errors", "sample", "item"), as_text=pg)
        await bulk_insert(conn, RolloutRow.__table__, rollouts, spec.chunk)  # type: ignore[arg-type]
        await bulk_insert(conn, ToolCall.__table__, calls, spec.chunk)  # type: ignore[arg-type]
        await bulk_insert(conn, Grade.__table__, grade_rows, spec.chunk)  # type: ignore[arg-type]
    items = min(spec.items, spec.rollouts)
    kinds = (
        [item_kind(i) for i in range(items)]
        if spec.scores != "learning"
        else [kind for kind, _ in learning_items(spec)[:items]]
    )
    return SeedResult(
        run=spec.run,
        rollouts=len(rollouts),
        calls=len(calls),
        grades=len(grades),
        items_always_zero=kinds.count("zero"),
        items_always_one=kinds.count("one"),
        items_mixed=kinds.count("mixed"),
    )
