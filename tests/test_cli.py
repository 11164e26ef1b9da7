"""The sparring command: job-config and dataset-tools come from the same registry as the routes."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.platforms import FOUNDRY_API_VERSION
from tests.conftest import create_pg_database, drop_pg_database, make_settings


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARRING_PACKS", "demo")
    # `serve` hands --host and --port to its workers through the environment: set them here so that
    # monkeypatch puts back what was there before (nothing) after each test, instead of leaking them.
    monkeypatch.setenv("SPARRING_HOST", "127.0.0.1")
    monkeypatch.setenv("SPARRING_PORT", "8000")
    for name in ("SPARRING_AUTH_HEADER", "SPARRING_GRADERS_FILE", "SPARRING_DEFAULT_GRADER"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def one_grader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    """A graders file with one string_check named `name` (job-config refuses a job with no grader)."""
    path = tmp_path / "graders.json"
    grader = {"type": "string_check", "name": name, "operation": "eq", "input": "a", "reference": "a"}
    path.write_text(json.dumps({name: grader}))
    monkeypatch.setenv("SPARRING_GRADERS_FILE", str(path))
    get_settings.cache_clear()


def reinforcement_block(output: str) -> dict[str, Any]:
    """The tools and grader of a job-config: Foundry's (the default) whole job holds them."""
    config = json.loads(output)
    assert config["platform"] == "foundry"
    block: dict[str, Any] = config["job"]["method"]["reinforcement"]
    return block


def test_job_config_lists_every_tool_with_its_url_and_a_key_placeholder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    one_grader(monkeypatch, tmp_path, "retail")
    result = CliRunner().invoke(
        cli, ["job-config", "--base-url", "https://rft.example.com/", "--grader", "retail"]
    )
    assert result.exit_code == 0, result.output
    config = reinforcement_block(result.stdout)
    assert [t["name"] for t in config["tools"]] == ["echo", "add_note", "list_notes"]
    assert config["tools"][0] == {
        "name": "echo",
        "server_url": "https://rft.example.com/tools/echo",
        "headers": {"Authorization": "Bearer <SPARRING_TOOLS_KEY>"},
    }
    assert config["grader"] == {
        "type": "endpoint",
        "name": "sparring-retail",
        "url": "https://rft.example.com/grade/retail",
        "headers": {"Authorization": "Bearer <SPARRING_GRADER_KEY>"},
        "rate_limit": 50,  # Foundry's, the default platform's
    }


def test_job_config_uses_the_configured_header_and_public_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    one_grader(monkeypatch, tmp_path, "exact")
    monkeypatch.setenv("SPARRING_AUTH_HEADER", "X-Functions-Key")
    monkeypatch.setenv("SPARRING_PUBLIC_BASE_URL", "https://public.example.com")
    result = CliRunner().invoke(cli, ["job-config"])
    config = reinforcement_block(result.stdout)
    assert config["tools"][1]["headers"] == {"X-Functions-Key": "<SPARRING_TOOLS_KEY>"}
    assert config["tools"][1]["server_url"] == "https://public.example.com/tools/add_note"
    assert config["grader"]["url"] == "https://public.example.com/grade"


def test_job_config_without_a_url_is_an_error() -> None:
    result = CliRunner().invoke(cli, ["job-config"])
    assert result.exit_code == 2
    assert "--base-url" in result.output


def test_dataset_tools_are_strict_function_tools() -> None:
    result = CliRunner().invoke(cli, ["dataset-tools"])
    tools = json.loads(result.output)
    assert {t["function"]["name"] for t in tools} == {"echo", "add_note", "list_notes"}
    assert all(t["type"] == "function" and t["function"]["strict"] for t in tools)


def test_tools_table() -> None:
    result = CliRunner().invoke(cli, ["tools"])
    assert result.exit_code == 0
    assert "add_note" in result.output and "yes" in result.output


def test_serve_refuses_a_public_address_without_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARRING_API_KEYS", raising=False)
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "without API keys" in result.output


def test_serve_has_no_access_log_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tool call is in the call log: uvicorn's line per request is opt-in (SPARRING_ACCESS_LOG)."""
    import uvicorn

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: seen.append(kwargs))
    monkeypatch.setattr("app.cli._check_startup", lambda settings: None)  # no database here: not served
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    monkeypatch.delenv("SPARRING_ACCESS_LOG", raising=False)
    assert CliRunner().invoke(cli, ["serve"]).exit_code == 0
    monkeypatch.setenv("SPARRING_ACCESS_LOG", "true")
    get_settings.cache_clear()
    assert CliRunner().invoke(cli, ["serve"]).exit_code == 0
    assert [kwargs["access_log"] for kwargs in seen] == [False, True]


def test_the_banner_names_the_review_pages_and_calls_an_enabled_tool(tmp_path: Path) -> None:
    from app.cli import example_arguments, startup_banner
    from app.packs import Registry
    from tests.packs import counter_pack

    settings = make_settings(tmp_path, host="127.0.0.1", port=8123)
    banner = startup_banner(settings, Registry.from_packs([counter_pack]), "k-123", created=True)
    assert "Review rollouts, runs and flags: http://127.0.0.1:8123/review" in banner
    assert "paste the admin key above" in banner and "    k-123" in banner
    assert "/tools/echo" not in banner  # the demo pack is not enabled here
    first = next(iter(counter_pack.tools.values()))
    assert f"curl -s http://127.0.0.1:8123/tools/{first.name} -H 'Authorization: Bearer k-123'" in banner
    # The example's arguments satisfy the tool's schema.
    body = json.loads(banner.split("-d '", 1)[1].split("'\n", 1)[0])
    arguments = json.loads(body["arguments"])
    assert set(arguments) == set(first.parameters.get("required") or [])
    for spec in counter_pack.tools.values():  # every tool's example binds
        spec.bind(example_arguments(spec.parameters))

    with_keys = startup_banner(settings, Registry.from_packs([counter_pack]), None)
    assert "an admin:... entry of SPARRING_API_KEYS" in with_keys and "<SPARRING_ADMIN_KEY>" in with_keys
    assert "No tool is enabled" in startup_banner(settings, Registry.from_packs([]), None)


class _Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    server_url: str
    headers: dict[str, str]


class _EndpointGrader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["endpoint"]
    name: str
    url: str
    headers: dict[str, str]
    rate_limit: int | None = None
    pass_threshold: float | None = None


class _Reinforcement(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tools: list[_Tool]
    grader: _EndpointGrader
    max_episode_steps: int
    hyperparameters: dict[str, float | int | str]


class _Method(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["reinforcement"]
    reinforcement: _Reinforcement


class _FoundryJob(BaseModel):
    """The shape the README documents for `job-config --platform foundry`."""

    model_config = ConfigDict(extra="forbid")
    model: str
    training_file: str
    validation_file: str
    suffix: str
    method: _Method


class _FoundryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    platform: Literal["foundry"]
    api_version: str
    job: _FoundryJob


def test_job_config_for_foundry_is_the_whole_job_in_the_documented_shape(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    one_grader(monkeypatch, tmp_path, "retail")
    monkeypatch.setenv("SPARRING_AUTH_HEADER", "X-Functions-Key")
    result = CliRunner().invoke(
        cli,
        [
            "job-config",
            "--platform",
            "foundry",
            "--base-url",
            "https://rft.example.com",
            "--grader",
            "retail",
            "--pass-threshold",
            "0.5",
        ],
    )
    assert result.exit_code == 0, result.output
    config = _FoundryConfig.model_validate_json(result.output)
    assert config.api_version == FOUNDRY_API_VERSION
    reinforcement = config.job.method.reinforcement
    assert [t.name for t in reinforcement.tools] == ["echo", "add_note", "list_notes"]
    assert reinforcement.tools[0].headers == {"X-Functions-Key": "<SPARRING_TOOLS_KEY>"}
    assert reinforcement.grader.url == "https://rft.example.com/grade/retail"
    assert reinforcement.grader.headers == {"X-Functions-Key": "<SPARRING_GRADER_KEY>"}
    assert reinforcement.grader.rate_limit == 50  # Foundry's default when not given
    assert reinforcement.grader.pass_threshold == 0.5
    assert reinforcement.max_episode_steps == 10
    assert reinforcement.hyperparameters["reasoning_effort"] == "medium"


def test_job_config_grader_fields_and_foundry_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    one_grader(monkeypatch, tmp_path, "exact")
    result = CliRunner().invoke(
        cli,
        [
            "job-config",
            "--base-url",
            "https://rft.example.com",
            "--platform",
            "openai",
            "--rate-limit",
            "20",
        ],
    )
    block = json.loads(result.stdout)
    assert set(block) == {"tools", "grader"}
    assert "warning: OpenAI's Agent RFT is closing" in result.output  # on stderr
    assert block["grader"]["rate_limit"] == 20 and "pass_threshold" not in block["grader"]

    result = CliRunner().invoke(
        cli,
        [
            "job-config",
            "--base-url",
            "https://rft.example.com",
            "--platform",
            "foundry",
            "--model",
            "gpt-5-2025-08-07",
            "--max-episode-steps",
            "50",
            "--rate-limit",
            "5",
        ],
    )
    job = json.loads(result.output)["job"]
    assert job["model"] == "gpt-5-2025-08-07"
    assert job["method"]["reinforcement"]["max_episode_steps"] == 50
    assert job["method"]["reinforcement"]["grader"]["rate_limit"] == 5


def test_job_config_refuses_an_unknown_platform() -> None:
    result = CliRunner().invoke(
        cli, ["job-config", "--base-url", "https://x.example", "--platform", "vertex"]
    )
    assert result.exit_code == 2
    assert "foundry, openai" in result.output


def test_foundry_is_the_default_platform_and_openai_a_legacy_choice_with_its_dates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    one_grader(monkeypatch, tmp_path, "exact")
    default = CliRunner().invoke(cli, ["job-config", "--base-url", "https://x.example"])
    assert default.exit_code == 0, default.output
    assert json.loads(default.stdout)["platform"] == "foundry" and "warning" not in default.output
    legacy = CliRunner().invoke(
        cli, ["job-config", "--base-url", "https://x.example", "--platform", "openai"]
    )
    assert legacy.exit_code == 0 and set(json.loads(legacy.stdout)) == {"tools", "grader"}
    for day in ("2026-12-11", "2026-10-23", "2027-01-06"):
        assert day in legacy.output  # the warning, on stderr
    shown = CliRunner().invoke(cli, ["job-config", "--help"], env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"})
    help_text = " ".join(shown.output.split())
    assert "foundry (the default)" in help_text
    for day in ("2026-12-11", "2026-10-23", "2027-01-06"):
        assert day in help_text


def test_serve_bounds_slow_and_idle_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keep-alive cap comes from SPARRING_KEEPALIVE_TIMEOUT_SECONDS; requests are read with deadlines."""
    import uvicorn

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: seen.append(kwargs))
    monkeypatch.setattr("app.cli._check_startup", lambda settings: None)  # no database here: not served
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    monkeypatch.setenv("SPARRING_KEEPALIVE_TIMEOUT_SECONDS", "7")
    assert CliRunner().invoke(cli, ["serve"]).exit_code == 0
    assert seen[0]["timeout_keep_alive"] == 7
    assert seen[0]["http"] == "app.serving:HttpToolsReadDeadlineProtocol"


@pytest.fixture(params=["embedded", "real"])
def never_migrated(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database that exists but was never migrated: an empty SQLite file, an empty Postgres database."""
    if request.param == "embedded":
        path = tmp_path / "empty.db"
        sqlite3.connect(path).close()
        yield f"sqlite+aiosqlite:///{path}"
        return
    name = f"sparring_empty_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = asyncio.run(create_pg_database(name))
    yield url
    asyncio.run(drop_pg_database(name))


@pytest.mark.parametrize(
    "command",
    [
        ["prune", "--older-than", "30d"],
        ["prune", "--older-than", "1d", "--dry-run"],
        ["export"],
        ["recompute-flags", "--run", "r1"],
        ["regrade", "--grader", "exact"],
        ["grade", "--grader", "exact", "--trace-id", "t1"],
        ["mcp", "--no-migrate"],
    ],
    ids=lambda command: command[0] + ("-dry" if "--dry-run" in command else ""),
)
def test_a_command_on_a_database_never_migrated_says_what_to_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, never_migrated: str, command: list[str]
) -> None:
    monkeypatch.setenv("SPARRING_DATABASE_URL", never_migrated)
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPARRING_REDIS_URL", raising=False)
    one_grader(monkeypatch, tmp_path, "exact")
    result = CliRunner().invoke(cli, command)
    # A clean exit with a message: typer.Exit, not an exception escaping the command.
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, (
        result.exception,
        result.output,
    )
    assert "never migrated" in result.output and "sparring db upgrade" in result.output, result.output
    assert "Traceback" not in result.output and "sqlalchemy" not in result.output.lower(), result.output


@pytest.mark.parametrize(
    "command",
    [["db", "upgrade"], ["db", "downgrade", "base"], ["serve", "--migrate"]],
    ids=lambda command: "-".join(command).lstrip("-"),
)
def test_a_migration_on_an_unreachable_database_says_so_in_a_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: list[str]
) -> None:
    """`sparring db upgrade` (the entrypoint's and the migrate Job's step) on a database that is down:
    the same line as every other command, exit 1, not the driver's traceback."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the socket is closed
    monkeypatch.setenv("SPARRING_DATABASE_URL", f"postgresql+asyncpg://postgres:s3cret@127.0.0.1:{port}/x")
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    result = CliRunner().invoke(cli, command)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (
        result.exception,
        result.output,
    )
    assert "cannot reach the database" in result.output and "SPARRING_DATABASE_URL" in result.output
    assert "s3cret" not in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_refuses_a_port_that_does_not_exist(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    """A port past 65535 is refused before serving (the resolver took it modulo 65536: 70000 bound 4464
    while the banner and uvicorn's line said 70000)."""
    import uvicorn

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: seen.append(kwargs))
    monkeypatch.setattr("app.cli._check_startup", lambda settings: None)  # no database here: not served
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    for given in (["serve", f"--port={port}"], ["serve"]):
        monkeypatch.setenv("SPARRING_PORT", port)
        get_settings.cache_clear()
        result = CliRunner().invoke(cli, given)
        assert result.exit_code == 2, result.output
        assert "invalid settings" in result.output and "port" in result.output, result.output
    assert seen == []


@pytest.mark.parametrize(
    "keys", ["admin:s3cret-admin-key,tools", "admin:s3cret-admin-key,admn:other", "s3cret-key-without-scope"]
)
def test_a_malformed_key_list_is_refused_without_printing_the_keys(
    monkeypatch: pytest.MonkeyPatch, keys: str
) -> None:
    """The message names the bad entry; the keys (the admin's among them) stay out of the logs."""
    monkeypatch.setenv("SPARRING_API_KEYS", keys)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert "invalid settings" in result.output and "api_keys" in result.output, result.output
    assert "s3cret" not in result.output, result.output


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("SPARRING_DATABASE_URL", "postgres://sparring:s3cret@127.0.0.1/sparring"),
        ("SPARRING_DATABASE_URL", "postgresql://sparring:s3cret@127.0.0.1/sparring"),
        ("SPARRING_DATABASE_URL", "127.0.0.1:5432/sparring"),
        ("SPARRING_REDIS_URL", "127.0.0.1:6379"),
        ("SPARRING_REDIS_URL", "http://:s3cret@127.0.0.1:6379/0"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "grpc://collector:4317"),
    ],
)
def test_a_url_the_server_cannot_use_is_refused_before_serving(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, url: str
) -> None:
    """A database URL without an async driver, a Redis URL without its scheme: one line naming the
    setting, exit 2 (they were tracebacks of the driver at start-up). An OTLP endpoint that is not an
    http(s) URL too (it served, and lost every span)."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path))
    monkeypatch.setenv(name, url)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["serve"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, (
        result.exception,
        result.output,
    )
    assert "invalid settings" in result.output and name in result.output, result.output
    assert "s3cret" not in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("header", ["", "Authorization ", "X-Api-Key:", "X Api Key"])
def test_a_key_header_no_request_can_send_is_refused_before_serving(
    monkeypatch: pytest.MonkeyPatch, header: str
) -> None:
    """SPARRING_AUTH_HEADER must be a header name: with any other value every request was a 401."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr("app.cli._check_startup", lambda settings: None)  # no database here: not served
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    monkeypatch.setenv("SPARRING_AUTH_HEADER", header)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert "invalid settings" in result.output and "auth_header" in result.output, result.output


def test_export_to_a_file_it_cannot_write_blames_the_file_not_the_database(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPARRING_DATABASE_URL", raising=False)
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0
    out = tmp_path / "no-such-dir" / "export.jsonl"
    result = CliRunner().invoke(cli, ["export", "--out", str(out)])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, (
        result.exception,
        result.output,
    )
    assert str(out) in result.output and "database" not in result.output, result.output


def test_export_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    """`sparring export | head`: the reader stopping is not a database failure."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "SPARRING_HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    env.pop("SPARRING_DATABASE_URL", None)
    command = [sys.executable, "-m", "app.cli"]
    for args in (["db", "upgrade"], ["seed-rollouts", "--rollouts", "300", "--items", "10"]):
        subprocess.run([*command, *args], env=env, check=True, capture_output=True, timeout=120)
    exporting = subprocess.Popen(
        [*command, "export"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert exporting.stdout is not None and exporting.stderr is not None
    assert exporting.stdout.read(100)
    exporting.stdout.close()  # the reader stops, as `head -c 100` does
    errors = exporting.stderr.read().decode()
    exporting.wait(timeout=120)
    assert "database" not in errors and "Traceback" not in errors and "Exception" not in errors, errors


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SPARRING_LOCK_TIMEOUT_SECONDS", "inf"),
        ("SPARRING_CLAIM_TIMEOUT_SECONDS", "Infinity"),
        ("SPARRING_USER_TEMPERATURE", "inf"),
        ("SPARRING_REMOTE_LEASE_SECONDS", "inf"),
    ],
)
def test_an_infinite_setting_is_refused_before_serving(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """A duration or a temperature must be a number: an infinite lock expiry was a traceback of the Redis
    store at start-up, an infinite temperature a failure of every simulated user turn."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr("app.cli._check_startup", lambda settings: None)  # no database here: not served
    monkeypatch.setenv("SPARRING_API_KEYS", "tools:t1")
    monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert "invalid settings" in result.output and name.removeprefix("SPARRING_").lower() in result.output
