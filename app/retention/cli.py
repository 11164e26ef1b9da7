"""`sparring prune` (mounted into `sparring`): remove old rollouts, their calls and grades."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from app.cli_support import fail, load_settings, migrated_database
from app.retention.repository import Removed

retention_cli = typer.Typer(help="Retention of the call log.")


def _describe(removed: Removed) -> str:
    return (
        f"{removed.rollouts:,} rollouts, {removed.calls:,} calls, {removed.grades:,} grades, "
        f"{removed.transcripts:,} transcripts, {removed.labels:,} labels, "
        f"{removed.kept_states:,} kept states, {removed.remote_rollouts:,} remote rollouts"
    )


@retention_cli.command("prune")
def prune_command(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than",
            help="Age: a rollout with no call and no grade for this long goes, e.g. 30d, 12h, 2w.",
        ),
    ],
    run: Annotated[str | None, typer.Option(help="Only rollouts of this run label (X-Sparring-Run).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")] = False,
    batch_size: Annotated[
        int,
        typer.Option(min=1, max=100_000, help="Rollouts per transaction (their calls and grades with them)."),
    ] = 500,
) -> None:
    """Delete old rollouts with their logged calls and grades, in short batches beside a running server."""
    from datetime import UTC, datetime

    from app.retention.service import parse_age, prune

    now = datetime.now(UTC)
    try:
        age = parse_age(older_than)
        cutoff = (now - age).isoformat(timespec="seconds")
    except ValueError as exc:
        raise fail(f"--older-than: {exc}") from exc
    except OverflowError as exc:  # before year 1
        raise fail(f"--older-than: {older_than!r} reaches back before the calendar") from exc
    settings = load_settings()
    scope = f" of run {run!r}" if run is not None else ""

    def report(removed: Removed) -> None:
        typer.echo(f"  removed {_describe(removed)}", err=True)

    def report_partition(name: str, calls: int) -> None:
        typer.echo(f"  dropped partition {name} ({calls:,} calls)", err=True)

    async def work() -> Removed:
        async with migrated_database(settings, pool_size=1) as engine:
            return await prune(
                engine,
                older_than=age,
                run=run,
                batch_size=batch_size,
                dry_run=dry_run,
                now=now,
                on_batch=report,
                on_partition=report_partition,
            )

    total = asyncio.run(work())
    verb = "would remove" if dry_run else "removed"
    typer.echo(f"{verb} {_describe(total)}{scope} older than {cutoff}")
