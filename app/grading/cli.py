"""Grading commands (mounted into `sparring`): try a grader on one sample, re-score stored rollouts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
import typer

from app.cli_support import checked_engine, fail, load_settings
from app.config import Settings

grading_cli = typer.Typer(help="Graders: try one on a sample, re-score stored rollouts.")

T = TypeVar("T")


def _read_json(path: Path | None, what: str) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise fail(f"cannot read the {what} file {path}: {exc.strerror or exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise fail(f"the {what} file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise fail(f"the {what} file {path} must hold a JSON object, not a {type(data).__name__}")
    return data


@asynccontextmanager
async def grading_service(settings: Settings, *, reads_log: bool = False) -> AsyncIterator[Any]:
    """The server's grading service, built as the server builds it, for one command; `reads_log`
    checks the database first (a command grading one sample may run without one)."""
    from app.db.session import Database, build_engine, build_sessionmaker
    from app.errors import StartupError
    from app.grading.build import build_grading
    from app.grading.graders.registry import GraderContext
    from app.metrics import Metrics
    from app.packs import PackLoadError, Registry, start_packs
    from app.rollouts.build import build_store

    try:
        declared = Registry.from_names(settings.packs)
    except PackLoadError as exc:
        raise fail(str(exc)) from exc
    async with AsyncExitStack() as stack:
        try:
            # The packs' state checks need their resources and base, as in the server.
            registry = await stack.enter_async_context(
                start_packs(declared, home=settings.home, binds_loopback=settings.binds_loopback)
            )
        except StartupError as exc:
            raise fail(str(exc)) from exc
        context = GraderContext.from_settings(settings, state_checks=registry.state_checks)
        stack.push_async_callback(context.aclose)
        engine = (
            await checked_engine(settings)
            if reads_log
            else build_engine(settings.effective_database_url, pool_size=2)
        )
        stack.push_async_callback(engine.dispose)
        try:
            store = build_store(settings)
        except StartupError as exc:  # a Redis Cluster URL naming a database, say
            raise fail(str(exc)) from exc
        stack.push_async_callback(store.aclose)
        try:
            yield build_grading(
                settings,
                registry,
                context,
                store=store,
                database=Database(build_sessionmaker(engine), settings.retry_after_seconds),
                metrics=Metrics(None),
            )
        except StartupError as exc:
            raise fail(str(exc)) from exc


def _run(settings: Settings, work: Callable[[Any], Awaitable[T]], *, reads_log: bool = False) -> T:
    async def main() -> T:
        async with grading_service(settings, reads_log=reads_log) as service:
            return await work(service)

    return asyncio.run(main())


@grading_cli.command("grade")
def grade(
    grader: Annotated[
        str | None, typer.Option(help="Grader name (default: the server's default grader).")
    ] = None,
    sample: Annotated[
        Path | None, typer.Option(help="JSON file with the `sample` (the model's answer).")
    ] = None,
    item: Annotated[Path | None, typer.Option(help="JSON file with the `item` (the dataset row).")] = None,
    trace_id: Annotated[
        str | None, typer.Option(help="A recorded rollout whose calls and state the grader may read.")
    ] = None,
) -> None:
    """Score one sample with a grader; print the score and every sub-score (nothing is stored)."""
    from app.errors import SparringError
    from app.rollouts.identity import trace_key

    settings = load_settings()
    sample_data = _read_json(sample, "sample")
    item_data = _read_json(item, "item")
    # Keyed as the tool routes and `/grade` key it: a long id is cut (with its hash) once, here.
    key = trace_key(trace_id) if trace_id else None

    async def work(service: Any) -> Any:
        chosen = service.resolve(grader)
        # A grader that reads the rollout's state refuses (RolloutStateLost, exit 1) when this process
        # cannot read it: in memory in the server process, or expired in Redis.
        _, inputs = await service.prepare(chosen, sample_data, item_data, key)
        return chosen, await chosen.grade(inputs)

    try:
        chosen, result = _run(settings, work, reads_log=trace_id is not None)
    except typer.Exit:
        raise
    except SparringError as exc:
        raise fail(exc.message, 1) from exc
    except Exception as exc:  # GraderUnavailable and the like: say what, exit non-zero
        raise fail(f"{type(exc).__name__}: {exc}", 1) from exc
    typer.echo(f"grader  {chosen.name} (version {chosen.version})")
    typer.echo(f"score   {result.score:.6g}")
    for name, value in sorted(result.sub_scores.items()):
        typer.echo(f"  {name}  {value:.6g}")
    for flag, reason in result.flags:
        typer.echo(f"flag    {flag}: {reason}")
    for error in result.errors:
        typer.echo(f"error   {error}")


@grading_cli.command("regrade")
def regrade(
    grader: Annotated[
        str, typer.Option(help="Grader to score the rollouts with (whether or not it graded them before).")
    ],
    run: Annotated[str | None, typer.Option(help="Only rollouts of this run label (X-Sparring-Run).")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many rollouts.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print how many rollouts would be scored; grade nothing.")
    ] = False,
) -> None:
    """Score every graded rollout (of a run) with a grader; new grades are stored beside the old ones."""
    from app.errors import SparringError

    settings = load_settings()
    try:
        if dry_run:
            stored, ungraded = _run(
                settings,
                lambda service: service.regrade_sources(grader, run=run, limit=limit),
                reads_log=True,
            )
            typer.echo(f"would regrade {len(stored)} rollouts with {grader}")
            _say_ungraded(ungraded)
            return
        report = _run(
            settings, lambda service: _regrade_with_progress(service, grader, run, limit), reads_log=True
        )
    except SparringError as exc:
        raise fail(exc.message, 1) from exc
    _print_regraded(report)
    if report.failed:
        raise typer.Exit(1)


async def _regrade_with_progress(service: Any, grader: str, run: str | None, limit: int | None) -> Any:
    """The regrade, with a progress bar on the terminal's error stream for a long run."""
    stored, _ = await service.regrade_sources(grader, run=run, limit=limit)
    if len(stored) < 50:
        return await service.regrade(grader, run=run, limit=limit)
    with typer.progressbar(length=len(stored), label="regrading", file=sys.stderr) as bar:
        return await service.regrade(grader, run=run, limit=limit, progress=lambda: bar.update(1))


def _say_ungraded(ungraded: int) -> None:
    if ungraded:
        typer.echo(
            f"not regraded: {ungraded} rollouts of the run were never graded (no answer is stored to "
            "grade them on)",
            err=True,
        )


def _print_regraded(report: Any) -> None:
    def mean(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    typer.echo(
        f"regraded {report.rollouts - report.skipped - report.failed} of {report.rollouts} rollouts with "
        f"{report.grader} (version {report.version}): {report.changed} scores new or changed, "
        f"{report.failed} failed, {report.skipped} skipped (no state kept); "
        f"mean {mean(report.mean_before)} -> {mean(report.mean_after)} (over the rollouts regraded)"
    )
    if report.skipped:
        typer.echo(
            f"skipped {report.skipped} rollouts: the grader reads their state, which the state store no "
            "longer holds (expired after SPARRING_STATE_TTL_SECONDS, or in memory in a server that "
            "restarted) and which was not kept (they were not graded while it was held); nothing was "
            "stored for them",
            err=True,
        )
    _say_ungraded(report.ungraded)
