"""Review commands (mounted into `sparring`): export rollouts as JSONL, recompute flags, seed a run."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli_support import fail, load_settings, migrated_database

review_cli = typer.Typer(help="Review: export rollouts, recompute flags, seed synthetic runs.")

T = TypeVar("T")


def _with_engine(work: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    settings = load_settings()

    async def run() -> T:
        async with migrated_database(settings) as engine:
            return await work(engine)

    return asyncio.run(run())


async def export_to(engine: AsyncEngine, run: str | None, out: Path | None) -> int:
    """Write the export (the same lines as GET /export) to `out`, or stdout; returns the line count."""
    from app.db.session import build_sessionmaker
    from app.review.service import RolloutReview

    count = 0
    try:
        sink = out.open("wb") if out is not None else sys.stdout.buffer
    except OSError as exc:  # not the database's failure, which the command reports as such
        raise fail(f"cannot write {out}: {exc.strerror or exc}") from exc
    try:
        async with build_sessionmaker(engine)() as session:
            async for line in RolloutReview(session).export_lines(run):
                try:
                    sink.write(line)
                except OSError as exc:
                    raise _write_failed(exc, out) from exc
                count += 1
    finally:
        try:
            if out is not None:
                sink.close()
            else:
                sink.flush()
        except OSError as exc:
            raise _write_failed(exc, out) from exc
    return count


def _write_failed(exc: OSError, out: Path | None) -> typer.Exit:
    """The exit of an export whose output failed: quietly when the reader of standard output stopped
    (`sparring export | head`), else what failed (a full disk), never as a database failure."""
    if out is None and isinstance(exc, BrokenPipeError):
        # What is left in the buffer has nobody to go to: standard output points at /dev/null from here.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return typer.Exit(1)
    return fail(f"cannot write {out or 'to standard output'}: {exc.strerror or exc}", 1)


@review_cli.command("export")
def export(
    run: Annotated[
        str | None, typer.Option(help="Run label (X-Sparring-Run); omit for every rollout.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="File to write (JSONL); default: standard output.")] = None,
) -> None:
    """Export rollouts with their calls and grades as JSONL, one rollout per line."""
    count = _with_engine(lambda engine: export_to(engine, run, out))
    if out is not None:
        typer.echo(f"exported {count} rollouts to {out}", err=True)


async def recompute_run(engine: AsyncEngine, run: str) -> int:
    from app.db.session import build_sessionmaker
    from app.review.repository import ReviewRepository
    from app.review.service import RolloutReview

    sessions = build_sessionmaker(engine)
    async with sessions() as session:
        trace_ids = await ReviewRepository(session).grade_ids_for_run(run)
    for start in range(0, len(trace_ids), 200):
        async with sessions() as session, session.begin():
            service = RolloutReview(session)
            for trace_id in trace_ids[start : start + 200]:
                await service.recompute_flags(trace_id)
    return len(trace_ids)


@review_cli.command("recompute-flags")
def recompute_flags(
    run: Annotated[str, typer.Option(help="Run label whose graded rollouts to re-flag.")],
) -> None:
    """Recompute the review flags of every graded rollout of a run (after changing the checks)."""
    count = _with_engine(lambda engine: recompute_run(engine, run))
    typer.echo(f"recomputed the flags of {count} rollouts")


@review_cli.command("seed-rollouts")
def seed_rollouts(
    run: Annotated[str, typer.Option(help="Run label of the synthetic rollouts.")] = "seed",
    rollouts: Annotated[int, typer.Option(min=1, help="How many rollouts.")] = 1000,
    items: Annotated[int, typer.Option(min=1, help="How many distinct items.")] = 100,
    max_calls: Annotated[int, typer.Option(min=1, help="Most calls in one rollout.")] = 18,
    seed: Annotated[int, typer.Option(help="Random seed: another seed, another run.")] = 7,
    scores: Annotated[
        str,
        typer.Option(
            help="learning: the seed picks items always 0, always 1 or learnable, whose success rises "
            "over the run; known: item i is always 0, always 1 or alternating by i % 3 (for checks)."
        ),
    ] = "learning",
) -> None:
    """Insert synthetic graded rollouts (items always 0, always 1 and mixed) for demos and benchmarks."""
    from app.review.seed import SeedSpec, seed_run

    if scores not in ("learning", "known"):
        typer.echo("error: --scores is learning or known", err=True)
        raise typer.Exit(2)
    spec = SeedSpec(
        run=run,
        rollouts=rollouts,
        items=items,
        max_calls=max_calls,
        min_calls=min(2, max_calls),
        seed=seed,
        scores=scores,
        trace_prefix=f"seed{seed}",
    )
    result = _with_engine(lambda engine: seed_run(engine, spec))
    typer.echo(
        f"inserted {result.rollouts} rollouts, {result.calls} calls, {result.grades} grades in run {run!r}"
    )


graders_cli = typer.Typer(help="Graders measured against each other and against people's labels.")


async def agreement_of_run(engine: AsyncEngine, run: str, threshold: float) -> Any:
    from app.db.session import build_sessionmaker
    from app.review.agreement import GraderAgreement

    async with build_sessionmaker(engine)() as session:
        return await GraderAgreement(session).figures(run, threshold)


def _stat(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


@graders_cli.command("agreement")
def agreement(
    run: Annotated[str, typer.Option(help="Run label (X-Sparring-Run).")],
    threshold: Annotated[float, typer.Option(help='A score at or above it is a "pass".')] = 0.5,
    json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of tables.")] = False,
) -> None:
    """Grader against grader and grader against labels on a run: n, agreement, kappa, Spearman,
    precision and recall, and the rollouts they disagree on (as GET /review/api/runs/{run}/agreement)."""
    figures = _with_engine(lambda engine: agreement_of_run(engine, run, threshold))
    if json:
        typer.echo(figures.model_dump_json(indent=2))
        return
    typer.echo(f"run {run}, pass at score >= {threshold:g} ('-': undefined on these scores)")
    typer.echo("grader pairs: a, b, rollouts, agreement, kappa, spearman, disagreements")
    for p in figures.pairs:
        typer.echo(
            f"  {p.a}  {p.b}  {p.n}  {_stat(p.agreement)}  {_stat(p.kappa)}  {_stat(p.spearman)}  "
            f"{p.disagreed}  {' '.join(p.disagreements[:10])}"
        )
    if not figures.pairs:
        typer.echo("  (no two graders scored the same rollouts: sparring regrade --grader NAME --run RUN)")
    typer.echo("against labels: grader, rollouts, agreement, kappa, precision, recall, disagreements")
    for g in figures.labels:
        typer.echo(
            f"  {g.grader}  {g.n}  {_stat(g.agreement)}  {_stat(g.kappa)}  {_stat(g.precision)}  "
            f"{_stat(g.recall)}  {g.disagreed}  {' '.join(g.disagreements[:10])}"
        )
    if not figures.labels:
        typer.echo("  (no labelled rollout is graded: label some on the run's queue page)")


async def audit_of_run(engine: AsyncEngine, run: str, grader: str | None) -> Any:
    from app.db.session import build_sessionmaker
    from app.review.audit import AuditThresholds, RunAudit

    thresholds = AuditThresholds.from_settings(load_settings())
    async with build_sessionmaker(engine)() as session:
        return await RunAudit(session, thresholds).audit(run, grader)


@review_cli.command("audit")
def audit(
    run: Annotated[str, typer.Option(help="Run label (X-Sparring-Run).")],
    grader: Annotated[
        str | None, typer.Option(help="The reward's grader (default: each rollout's latest grade).")
    ] = None,
    json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of lines.")] = False,
) -> None:
    """Audit a run for reward hacking: each signal with its evidence; exit 1 when one fires (thresholds:
    SPARRING_AUDIT_*)."""
    report = _with_engine(lambda engine: audit_of_run(engine, run, grader))
    if json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        typer.echo(f"run {run}: {report.rollouts} graded rollouts, {report.windows} windows (first vs last)")
        if report.note:
            typer.echo(f"  {report.note}")
        for signal in report.signals:
            typer.echo(f"{'FIRED' if signal.fired else 'quiet'}  {signal.name}: {signal.summary}")
            if signal.evidence:
                typer.echo(f"       open: {' '.join(signal.evidence)}")
    if report.fired:
        raise typer.Exit(1)
