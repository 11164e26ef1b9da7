"""The `sparring` command: serve, inspect tools, print job configs, manage the database."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli_support import fail, load_settings
from app.config import Settings, get_settings
from app.eval_cli import runner_cli
from app.grading.cli import grading_cli
from app.retention.cli import retention_cli
from app.review.cli import graders_cli, review_cli

cli = typer.Typer(
    help="sparring: tools and graders for agent reinforcement fine-tuning.", no_args_is_help=True
)
db_cli = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
cli.add_typer(db_cli, name="db")
cli.add_typer(grading_cli)
packs_cli = typer.Typer(help="Tool packs: fetch their data ahead of serving.", no_args_is_help=True)
cli.add_typer(packs_cli, name="packs")
dataset_cli = typer.Typer(help="Agent RFT datasets of the packs that ship tasks.", no_args_is_help=True)
cli.add_typer(dataset_cli, name="dataset")
cli.add_typer(review_cli)
cli.add_typer(graders_cli, name="graders")
cli.add_typer(retention_cli)
cli.add_typer(runner_cli)

KEY_PLACEHOLDER = "<SPARRING_{scope}_KEY>"


def _registry(settings: Settings) -> Any:
    from app.errors import StartupError
    from app.packs import PackLoadError, Registry
    from app.users.service import offer_user_tool

    try:
        registry = Registry.from_names(settings.packs)
        if settings.user_tool:  # the tools the server would serve: send_message_to_user too
            offer_user_tool(registry)
        return registry
    except (PackLoadError, StartupError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _auth_header(settings: Settings, scope: str) -> dict[str, str]:
    placeholder = KEY_PLACEHOLDER.format(scope=scope.upper())
    if settings.auth_header.lower() == "authorization":
        return {"Authorization": f"Bearer {placeholder}"}
    return {settings.auth_header: placeholder}


def example_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """Arguments that satisfy a tool's required parameters, for a first curl."""
    samples = {"string": "hi", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    properties = parameters.get("properties") or {}
    out: dict[str, Any] = {}
    for name in parameters.get("required") or []:
        schema = properties.get(name) or {}
        if schema.get("enum"):
            out[name] = schema["enum"][0]
            continue
        options = schema.get("anyOf") or []
        if any(o.get("type") == "null" for o in options):
            out[name] = None  # an optional parameter: the tool's default applies
            continue
        kind = schema.get("type") or next((o.get("type") for o in options), None)
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        out[name] = samples.get(str(kind), "hi")
    return out


def startup_banner(settings: Settings, registry: Any, key: str | None, *, created: bool = False) -> str:
    """What `sparring serve` prints first: the review pages and how to log in, and a first tool call."""
    base = f"http://{settings.host}:{settings.port}"
    lines = [""]
    if key is not None:
        where = settings.home / "admin.key"
        lines += [
            f"  {'Created' if created else 'Using'} the local admin key (stored in {where}):",
            f"    {key}",
            "",
        ]
        login = "paste the admin key above"
        shown = key
    else:
        login = "paste an admin key (an admin:... entry of SPARRING_API_KEYS)"
        shown = KEY_PLACEHOLDER.format(scope="ADMIN")
    lines += [
        f"  Review rollouts, runs and flags: {base}/review",
        f"    log in: {login}; the API docs are at {base}/docs once logged in",
        "",
    ]
    tools = list(registry.tools.values())
    if tools:
        tool = tools[0]
        body = json.dumps(
            {
                "call_id": "call_1",
                "trace_id": "trace_demo",
                "arguments": json.dumps(example_arguments(tool.parameters)),
            }
        )
        header = settings.auth_header
        value = f"Bearer {shown}" if header.lower() == "authorization" else shown
        lines += [
            f"  Try a tool call ({tool.name}, pack {tool.pack}):",
            f"    curl -s {base}/tools/{tool.name} -H '{header}: {value}' \\",
            f"      -d '{body}'",
            "",
        ]
    else:
        lines += ["  No tool is enabled: set SPARRING_PACKS (e.g. demo).", ""]
    return "\n".join(lines)


@cli.command()
def serve(
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default SPARRING_HOST or 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default SPARRING_PORT or 8000).")] = None,
    workers: Annotated[
        int | None,
        typer.Option(min=1, help="Worker processes (default SPARRING_WORKERS or 1; > 1 needs Redis)."),
    ] = None,
    migrate: Annotated[bool, typer.Option(help="Run database migrations before serving.")] = False,
    debug: Annotated[
        bool,
        typer.Option(help="Show the traceback of a start-up error (default: one line saying what to fix)."),
    ] = False,
) -> None:
    """Serve the API with uvicorn."""
    # Workers rebuild their settings from the environment: hand them the command line's choices.
    if host is not None:
        os.environ["SPARRING_HOST"] = host
    if port is not None:
        os.environ["SPARRING_PORT"] = str(port)
    if debug:
        os.environ["SPARRING_DEBUG"] = "1"
    get_settings.cache_clear()
    settings = load_settings()
    workers = workers if workers is not None else settings.workers
    _prepare_workers(settings, workers)
    if migrate:
        _upgrade(settings)
    if not settings.debug:  # with --debug the server's own start-up raises, with its traceback
        _check_startup(settings)
    key, created = None, False
    if not settings.keys:
        from app.auth import ensure_local_admin_key

        key, created = ensure_local_admin_key(settings.home)
    typer.echo(startup_banner(settings, _registry(settings), key, created=created))
    _run_uvicorn(settings, workers)


def _check_startup(settings: Settings) -> None:
    """What start-up would fail on, said in a line before anything is served (exit 2, or 1 when the
    database is unreachable): the packs, the graders file, the database and its schema."""
    import asyncio

    from app.cli_support import checked_engine

    _graders_served(settings, _registry(settings))

    async def check_database() -> None:
        engine = await checked_engine(settings)
        await engine.dispose()

    asyncio.run(check_database())


def _prepare_workers(settings: Settings, workers: int) -> None:
    """Refuse a setup that cannot serve safely (exit 2); give several workers a shared metrics dir."""
    if workers > 1 and settings.redis_url is None:
        typer.echo("error: --workers > 1 needs SPARRING_REDIS_URL (in-memory state is per process)", err=True)
        raise typer.Exit(2)
    if not settings.keys and not settings.binds_loopback:
        typer.echo(
            f"error: refusing to serve on {settings.host} without API keys: set SPARRING_API_KEYS", err=True
        )
        raise typer.Exit(2)
    if settings.metrics_dir is not None:
        # prometheus_client writes to files only under its own variable (read when it is imported, in
        # each worker): a directory given as SPARRING_METRICS_DIR is handed on, or /metrics reads it empty.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = settings.metrics_dir
    elif workers > 1:
        # Workers write their metrics to files in one directory that /metrics aggregates.
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sparring-metrics-")


def _run_uvicorn(settings: Settings, workers: int) -> None:
    import uvicorn

    from app.serving import http_protocol

    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=workers,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        # Off unless asked for: each tool call is already in the durable call log, and a line per
        # request costs every call (docs/deploy.md, bench/README.md).
        access_log=settings.access_log,
        log_level="info",
        log_config=_log_config(),
        # Deadlines on reading a request (app/serving.py) and on idle keep-alive connections.
        http=http_protocol(),
        timeout_keep_alive=settings.keepalive_timeout_seconds,
    )


@cli.command("mcp")
def mcp_stdio(
    run: Annotated[str, typer.Option(help="Run label of the calls (X-Sparring-Run over HTTP).")] = "local",
    trace_id: Annotated[
        str | None, typer.Option(help="Rollout of the calls (default trace_mcp_<session id>).")
    ] = None,
    migrate: Annotated[
        bool | None,
        typer.Option(help="Migrate the database first (default: only the embedded SQLite database)."),
    ] = None,
    pack: Annotated[
        str | None, typer.Option(help="Only this pack's tools (as /packs/PACK/mcp over HTTP).")
    ] = None,
) -> None:
    """Serve the tools as a local MCP server over stdio (for desktop agents and IDEs)."""
    import asyncio
    import contextlib
    import sys

    from app.main import create_app
    from app.mcp.stdio import serve_stdio

    settings = load_settings()
    if pack is not None:
        _enabled_pack(_registry(settings), pack)
    # stdout carries the protocol: whatever else would print goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        if migrate if migrate is not None else settings.is_embedded_db:
            _upgrade(settings)
    from app.db.migrate import SchemaOutOfDate
    from app.errors import StartupError

    try:
        asyncio.run(serve_stdio(create_app(settings), trace_id=trace_id, run=run, pack=pack))
    except (SchemaOutOfDate, StartupError) as exc:  # the message says what to change or run
        raise fail(str(exc)) from exc


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, plus the server's own loggers (start-up, packs, tools) at INFO."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for name in ("sparring", "app", "tools"):
        config["loggers"][name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


@cli.command("tools")
def list_tools() -> None:
    """List every served tool: name, pack, whether it changes state, description."""
    registry = _registry(load_settings())
    rows = [
        (s.name, s.pack, "yes" if s.mutates else "", s.description.splitlines()[0])
        for tools in registry.pack_tools.values()
        for s in tools.values()
    ]
    widths = [max(len(r[i]) for r in [("TOOL", "PACK", "MUTATES", ""), *rows]) for i in range(3)]
    typer.echo(f"{'TOOL':<{widths[0]}}  {'PACK':<{widths[1]}}  {'MUTATES':<{widths[2]}}  DESCRIPTION")
    for row in rows:
        typer.echo(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}")


def job_config(
    settings: Settings, registry: Any, base_url: str, grader: str | None, pack: str | None = None
) -> dict[str, Any]:
    """The `method.reinforcement` block pointing a fine-tuning job at this server: the tools at
    /tools/<name>, or with `pack` that pack's tools at /packs/<pack>/tools/<name>."""
    base = base_url.rstrip("/")
    prefix = f"{base}/tools" if pack is None else f"{base}/packs/{pack}/tools"
    block: dict[str, Any] = {
        "tools": [
            {"name": name, "server_url": f"{prefix}/{name}", "headers": _auth_header(settings, "tools")}
            for name in (registry.tools if pack is None else registry.pack_tools[pack])
        ],
    }
    grade_path = f"/grade/{grader}" if grader else "/grade"
    block["grader"] = {
        "type": "endpoint",
        "name": f"sparring-{grader or 'default'}",
        "url": f"{base}{grade_path}",
        "headers": _auth_header(settings, "grader"),
    }
    return block


@cli.command("job-config")
def job_config_command(
    base_url: Annotated[
        str | None, typer.Option(help="Public https URL of this server (default SPARRING_PUBLIC_BASE_URL).")
    ] = None,
    grader: Annotated[
        str | None, typer.Option(help="Grader name served at /grade/NAME (default: /grade).")
    ] = None,
    allow_http: Annotated[
        bool, typer.Option(help="Accept an http:// base URL (a local trainer; hosted services need https).")
    ] = False,
    platform: Annotated[
        str | None,
        typer.Option(
            help="foundry (the default): Microsoft Foundry's whole job with its API version; "
            "openai (legacy): the method.reinforcement block of OpenAI's Agent RFT, which is closing: "
            "gpt-5 and its fine-tunes shut down on 2026-12-11, o4-mini did on 2026-10-23, and OpenAI's "
            "self-serve fine-tuning takes no new jobs from 2027-01-06 on."
        ),
    ] = None,
    rate_limit: Annotated[
        int | None,
        typer.Option(min=1, help="The endpoint grader's rate_limit, requests/s (foundry default: 50)."),
    ] = None,
    pass_threshold: Annotated[
        float | None, typer.Option(help="The endpoint grader's pass_threshold (a score).")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Base model of the foundry job.")] = None,
    max_episode_steps: Annotated[
        int | None, typer.Option(min=1, help="max_episode_steps of the foundry job (default 10).")
    ] = None,
    pack: Annotated[
        str | None,
        typer.Option(
            help="Only this pack's tools, at its routes /packs/PACK/tools/NAME (default: the grader's "
            "pack, for a pack's own grader such as retail; needed when enabled packs share tool names)."
        ),
    ] = None,
) -> None:
    """Print the job's tools and grader entries as JSON (keys are placeholders): the whole job for
    Foundry (the default), the `method.reinforcement` block for OpenAI (legacy, closing).

    Checked against the registry and graders the server would serve: anything a job would fail on
    (an unknown grader, /grade with no default grader, a plain http URL) is an error, exit 2.
    """
    import math

    from app.platforms import FOUNDRY_GRADER_RATE_LIMIT, endpoint_grader_fields, foundry_job

    if pass_threshold is not None and not math.isfinite(pass_threshold):
        raise fail(f"--pass-threshold must be a finite score (got {pass_threshold})")
    settings = load_settings()
    chosen = _platform(platform)
    url = _public_url(base_url or settings.public_base_url, allow_http=allow_http)
    registry = _registry(settings)
    pack = pack or registry.grader_pack(_check_grader_served(settings, registry, grader))
    _check_pack(registry, pack)
    block = job_config(settings, registry, url, grader, pack)
    if chosen == "foundry" and rate_limit is None:
        rate_limit = FOUNDRY_GRADER_RATE_LIMIT
    block["grader"] = endpoint_grader_fields(
        block["grader"], rate_limit=rate_limit, pass_threshold=pass_threshold
    )
    out = (
        foundry_job(block, model=model, max_episode_steps=max_episode_steps) if chosen == "foundry" else block
    )
    typer.echo(json.dumps(out, indent=2))


def _enabled_pack(registry: Any, pack: str) -> None:
    """Fail for a pack that is not enabled, naming the enabled ones."""
    if pack not in registry.pack_tools:
        enabled = ", ".join(registry.pack_tools) or "none"
        raise fail(f"--pack {pack!r} is not enabled (SPARRING_PACKS: {enabled})")


def _check_pack(registry: Any, pack: str | None) -> None:
    """Fail for a pack that is not enabled, or, without one, when enabled packs share tool names."""
    if pack is not None:
        _enabled_pack(registry, pack)
    if pack is None and registry.shared:
        shared = ", ".join(f"{name} ({'/'.join(packs)})" for name, packs in sorted(registry.shared.items()))
        raise fail(f"enabled packs share tool names ({shared}): pass --pack NAME for one pack's tools")


def _platform(platform: str | None) -> str:
    """The training platform asked for, or the default one (Foundry); OpenAI's, with a warning."""
    from app.platforms import DEFAULT_PLATFORM, OPENAI_CLOSING, PLATFORMS

    chosen = platform or DEFAULT_PLATFORM
    if chosen not in PLATFORMS:
        raise fail(f"--platform must be one of {', '.join(PLATFORMS)} (got {chosen!r})")
    if chosen == "openai":
        typer.echo(f"warning: {OPENAI_CLOSING}.", err=True)
    return chosen


def _public_url(url: str | None, *, allow_http: bool) -> str:
    """The server's public URL as training services will call it: https, or http when allowed."""
    if not url:
        raise fail("give --base-url https://your-host (or set SPARRING_PUBLIC_BASE_URL)")
    if not url.startswith("https://") and not (allow_http and url.startswith("http://")):
        raise fail(f"training services call tools and graders over https only; {url!r} is not https")
    return url


def _check_grader_served(settings: Settings, registry: Any, grader: str | None) -> str:
    """Fail unless the server serves `grader` (or, with none named, a default grader at /grade); the
    grader's name (the default's, with none named)."""
    names, default = _graders_served(settings, registry)
    known = ", ".join(sorted(names)) or "none"
    if not names:
        raise fail("no grader is configured (set SPARRING_GRADERS_FILE, or enable a pack with a state check)")
    if grader is not None and grader not in names:
        raise fail(f"no grader named {grader!r}; configured: {known}")
    if grader is None and default is None:
        raise fail(
            f"POST /grade has no default grader: pass --grader NAME (one of {known}) "
            "or set SPARRING_DEFAULT_GRADER"
        )
    return grader if grader is not None else str(default)


def _graders_served(settings: Settings, registry: Any) -> tuple[set[str], str | None]:
    """The grader names the server would serve and the one behind POST /grade (None: no default)."""
    from app.errors import StartupError
    from app.grading.build import default_grader
    from app.grading.graders.model import GraderConfigError
    from app.grading.graders.registry import load_graders_file

    try:
        configs = load_graders_file(settings.graders_file) if settings.graders_file is not None else {}
    except GraderConfigError as exc:
        raise fail(f"invalid grader config (SPARRING_GRADERS_FILE): {exc}") from None
    names = set(configs) | set(registry.state_checks)
    try:
        return names, default_grader(settings, [*configs, *registry.state_checks], registry.state_checks)
    except StartupError as exc:
        raise fail(str(exc)) from None


@cli.command("dataset-tools")
def dataset_tools(
    pack: Annotated[
        str | None,
        typer.Option(help="One pack's tools, its shared names included (default: the grader's pack)."),
    ] = None,
    grader: Annotated[
        str | None, typer.Option(help="The job's grader: a pack's own grader (retail) picks its pack.")
    ] = None,
) -> None:
    """Print the `tools` array every dataset line carries, from the same registry the server uses."""
    settings = load_settings()
    registry = _registry(settings)
    if grader is not None:
        pack = pack or registry.grader_pack(_check_grader_served(settings, registry, grader))
    _check_pack(registry, pack)
    typer.echo(json.dumps(registry.dataset_tools(pack), indent=2))


def _migrate(settings: Settings, step: Callable[[str, str], None], revision: str) -> None:
    """Run an Alembic `step` (upgrade or downgrade) to `revision`, once the database answers: one that
    cannot be reached is a failed exit naming the setting (as for every command that reads it), not the
    driver's traceback; a migration that fails on a database that answers keeps its traceback."""
    import asyncio

    from app.db.migrate import unreachable_database
    from app.db.session import build_engine
    from app.errors import OUTAGES

    url = settings.effective_database_url

    async def reach() -> None:
        engine = build_engine(url, pool_size=1)
        try:
            async with engine.connect():
                pass
        finally:
            await engine.dispose()

    try:
        asyncio.run(reach())
    except OUTAGES as exc:
        raise fail(unreachable_database(url, exc), 1) from exc
    step(url, revision)


def _upgrade(settings: Settings, revision: str = "head") -> None:
    from app.db.migrate import upgrade

    if settings.is_embedded_db:
        settings.home.mkdir(parents=True, exist_ok=True)
    _migrate(settings, upgrade, revision)


@db_cli.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Migrate the database to the latest schema (safe to run from several replicas at once)."""
    _upgrade(load_settings(), revision)
    typer.echo("database schema is up to date" if revision == "head" else f"database at {revision}")


@db_cli.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target revision, e.g. -1 or base.")]) -> None:
    """Migrate the database down to an earlier revision."""
    from app.db.migrate import downgrade

    _migrate(load_settings(), downgrade, revision)
    typer.echo(f"database at {revision}")


@db_cli.command("partitions")
def db_partitions() -> None:
    """Postgres: make the call log's day partitions ahead (as the server does hourly), and list them."""
    import asyncio

    from sqlalchemy import text

    from app.cli_support import migrated_database
    from app.db.partitions import AHEAD_DAYS, DEFAULT_PARTITION, partitions
    from app.retention.service import make_partitions

    settings = load_settings()

    async def work() -> tuple[list[str], list[str], int]:
        async with migrated_database(settings, pool_size=1) as engine:
            if engine.dialect.name != "postgresql":
                return [], [], 0
            made = await make_partitions(engine)
            async with engine.connect() as conn:
                days = [part.name for part in await conn.run_sync(partitions)]
                stray = await conn.scalar(text(f"SELECT count(*) FROM {DEFAULT_PARTITION}"))
            return made, days, int(stray or 0)

    made, days, stray = asyncio.run(work())
    if not days:
        typer.echo("the call log is one table here (SQLite): it has no partitions")
        return
    listed = f": {', '.join(made)}" if made else f" (the next {AHEAD_DAYS} days had theirs)"
    typer.echo(f"made {len(made)} partitions{listed}")
    typer.echo(f"{len(days)} day partitions, {days[0]} to {days[-1]}; {stray:,} calls in {DEFAULT_PARTITION}")


def _with_started_pack(settings: Settings, name: str, work: Callable[[Any, object], int]) -> int:
    """Load pack `name`, start it (its lifespan finds or fetches its data), run `work(pack, resources)`."""
    import anyio

    from app.errors import StartupError
    from app.packs import PackLoadError, load_pack, start_pack

    try:
        pack = load_pack(name)
    except PackLoadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc

    async def run() -> int:
        async with start_pack(pack, home=settings.home, binds_loopback=settings.binds_loopback) as started:
            return await anyio.to_thread.run_sync(work, started, started.resources)

    try:
        return anyio.run(run)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


@packs_cli.command("fetch")
def packs_fetch(name: Annotated[str, typer.Argument(help="Pack name, e.g. retail.")]) -> None:
    """Fetch and check a pack's data now (the server would otherwise do it on first start)."""
    _with_started_pack(load_settings(), name, lambda pack, resources: 0)
    typer.echo(f"pack {name!r} is ready")


@dataset_cli.command("build")
def dataset_build(
    name: Annotated[str | None, typer.Argument(help="Pack name, e.g. retail (or --pack).")] = None,
    pack_name: Annotated[str | None, typer.Option("--pack", help="Pack name, e.g. retail.")] = None,
    split: Annotated[str, typer.Option(help="Which tasks, e.g. train or test.")] = "train",
    out: Annotated[Path, typer.Option(help="JSONL file to write.")] = Path("dataset.jsonl"),
) -> None:
    """Write a pack's Agent RFT dataset (JSONL, one task per line): each line carries that pack's tools
    only, as /packs/PACK/tools serves them."""
    if name is not None and pack_name is not None and name != pack_name:
        raise fail(f"two packs named: {name!r} and --pack {pack_name!r}")
    name = name or pack_name
    if name is None:
        raise fail("name the pack: sparring dataset build --pack retail")

    def build(pack: Any, resources: object) -> int:
        if pack.dataset_builder is None:
            typer.echo(f"error: pack {name!r} ships no dataset", err=True)
            raise typer.Exit(2)
        try:
            count: int = pack.dataset_builder(resources, split, out)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        return count

    count = _with_started_pack(load_settings(), name, build)
    typer.echo(f"wrote {count} lines to {out}")


def main() -> None:
    cli(prog_name="sparring")


if __name__ == "__main__":
    main()
