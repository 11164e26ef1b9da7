"""`sparring eval` (a model through the tools and grader) and `sparring canary` (gaming the grader).

The commands read the settings and keys; everything they run is the client package (`sparring.*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from app.cli_support import fail, load_settings
from app.config import ClientKeys, environment_secret
from app.telemetry import command_tracing
from sparring.evaluate import DatasetError, Journal, journal_path, latest_per_rollout, read_dataset
from sparring.export import write_export
from sparring.http import AiohttpTransport
from sparring.loop import DatasetLine, EpisodeLimits, ModelFailure
from sparring.policies import (
    APIS,
    MODEL_ANSWER_MAX_BYTES,
    MODEL_DEADLINE_S,
    Api,
    ChatPolicy,
    DeadlinePolicy,
    check_model,
    make_policy,
    model_client,
    what_to_check,
)
from sparring.report import PASS_SCORE, discard_verdict, format_canaries, format_report
from sparring.session import (
    RunOptions,
    Target,
    TargetError,
    auth_headers,
    evaluate,
    job_config_target,
    preflight,
    run_canaries,
    server_target,
)
from sparring.usersim import DEFAULT_MAX_STEPS, DEFAULT_TEMPERATURE, SimulatedUser

if TYPE_CHECKING:
    from openai import AsyncOpenAI

runner_cli = typer.Typer(help="Rollouts before paying: a model's baseline, and canaries against the grader.")

T = TypeVar("T")

DatasetOpt = Annotated[
    Path, typer.Option(help="RFT dataset JSONL (each line: messages, tools, item fields).")
]
ServerOpt = Annotated[
    str | None,
    typer.Option(help="Base URL of the sparring server (tools at /tools/NAME, or --pack's routes)."),
]
JobConfigOpt = Annotated[
    Path | None,
    typer.Option(help="Job config JSON (`sparring job-config`): each tool's server_url and headers."),
]
GraderOpt = Annotated[str | None, typer.Option(help="Grader NAME served by --server at /grade/NAME.")]
GraderUrlOpt = Annotated[str | None, typer.Option(help="Full URL of the endpoint grader.")]
PackOpt = Annotated[
    str | None,
    typer.Option(
        help="The --server pack whose tools the lines call, at its routes (/packs/PACK/tools/NAME): "
        "needed for names several enabled packs share."
    ),
]
RunOpt = Annotated[
    str | None, typer.Option(help="Run label, sent as X-Sparring-Run (default: generated and printed).")
]
ConcurrencyOpt = Annotated[int, typer.Option(min=1, max=1000, help="Rollouts in flight at once.")]
MaxTurnsOpt = Annotated[int, typer.Option(min=1, help="Model turns per rollout before it ends.")]
MaxCallsOpt = Annotated[int, typer.Option(min=1, help="Tool calls per rollout before it ends.")]
MaxDiscardedOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        max=100.0,
        help="Exit 1 when more than this percentage of the rollouts is discarded (for CI). "
        "A run where nothing could be graded always exits 1.",
    ),
]

UserModelOpt = Annotated[
    str | None,
    typer.Option(
        help="Model that plays the customer of lines with a user scenario (τ²-bench's simulated user; "
        "chat completions, key from SPARRING_USER_API_KEY, else OPENAI_API_KEY). Unset: no user."
    ),
]
UserBaseUrlOpt = Annotated[
    str | None, typer.Option(help="OpenAI-compatible endpoint of --user-model (default: OpenAI).")
]
UserTemperatureOpt = Annotated[float, typer.Option(min=0.0, help="Sampling temperature of --user-model.")]
UserMaxStepsOpt = Annotated[
    int, typer.Option(min=1, help="Steps of a conversation with the user before it ends (τ²'s count).")
]
USER_KEY_ENVS = ("SPARRING_USER_API_KEY", "OPENAI_API_KEY")

PREFLIGHT_DEADLINE_S = 120.0
"""The longest wait for the model's pre-flight turn (less when --model-timeout is shorter)."""


def _label(prefix: str) -> str:
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _lines(dataset: Path) -> list[DatasetLine]:
    try:
        return read_dataset(dataset)
    except OSError as exc:
        raise fail(f"cannot read {dataset}: {exc.strerror or exc}") from exc
    except DatasetError as exc:
        raise fail(str(exc)) from exc


def _target(
    server: str | None,
    job_config: Path | None,
    grader: str | None,
    grader_url: str | None,
    pack: str | None = None,
) -> Target:
    keys = ClientKeys()
    auth_header = load_settings().auth_header
    if job_config is not None:
        if pack is not None:
            raise fail("--pack takes --server's tools; a job config's tools carry their own routes")
        try:
            config = json.loads(job_config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise fail(f"cannot read the job config {job_config}: {exc}") from exc
        if isinstance(config, dict) and isinstance(config.get("reinforcement"), dict):
            config = config["reinforcement"]
        if not isinstance(config, dict):
            raise fail(f"the job config {job_config} must hold a JSON object")
        grader_key = keys.for_scope("grader")
        override_headers = None
        if (grader or grader_url) and grader_key:
            override_headers = auth_headers(auth_header, grader_key)
        try:
            return job_config_target(
                config,
                keys.placeholders(),
                server=server,
                grader=grader,
                grader_url=grader_url,
                grader_headers=override_headers,
            )
        except TargetError as exc:
            raise fail(str(exc)) from exc
    if server is None:
        raise fail("give --server URL (one sparring server) or --job-config FILE")
    if grader is None and grader_url is None:
        raise fail("give --grader NAME (a grader of --server) or --grader-url URL")
    return server_target(
        server,
        tools_key=keys.for_scope("tools"),
        grader_key=keys.for_scope("grader"),
        grader=grader,
        grader_url=grader_url,
        auth_header=auth_header,
        pack=pack,
    )


@contextlib.contextmanager
def _interrupt_sets(stop: asyncio.Event) -> Iterator[None]:
    """Ctrl-C sets `stop`: rollouts in flight end, the report of what was done is printed."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
        installed = True
    except (NotImplementedError, RuntimeError):
        installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


def _run(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    async def wrapped() -> T:
        stop = asyncio.Event()
        with _interrupt_sets(stop):
            return await main(stop)

    return asyncio.run(wrapped())


def _warn(message: str) -> None:
    typer.echo(f"warning: {message}", err=True)


def _write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@runner_cli.command("eval")
def eval_command(
    dataset: DatasetOpt,
    model: Annotated[str, typer.Option(help="Model name at the endpoint.")],
    base_url: Annotated[
        str | None,
        typer.Option(help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8001/v1 (default: OpenAI)."),
    ] = None,
    api: Annotated[
        str, typer.Option(help="responses (the Responses API, as Agent RFT) or chat.")
    ] = "responses",
    api_key_env: Annotated[
        str, typer.Option(help="Environment variable holding the model API key.")
    ] = "OPENAI_API_KEY",
    server: ServerOpt = None,
    job_config: JobConfigOpt = None,
    grader: GraderOpt = None,
    grader_url: GraderUrlOpt = None,
    pack: PackOpt = None,
    run: RunOpt = None,
    samples: Annotated[int, typer.Option(min=1, help="Rollouts per dataset line.")] = 3,
    concurrency: ConcurrencyOpt = 8,
    max_turns: MaxTurnsOpt = 30,
    max_tool_calls: MaxCallsOpt = 50,
    model_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds one model turn may take in all (retries included) before the rollout fails.",
        ),
    ] = MODEL_DEADLINE_S,
    model_max_bytes: Annotated[
        int, typer.Option(min=1024, help="Largest model answer read; a larger one fails the rollout.")
    ] = MODEL_ANSWER_MAX_BYTES,
    resume: Annotated[bool, typer.Option(help="Skip rollouts of this --run already graded.")] = False,
    out: Annotated[Path | None, typer.Option(help="Also write the report as JSON here.")] = None,
    max_discarded: MaxDiscardedOpt = None,
    pass_threshold: Annotated[
        float, typer.Option(help="A rollout passes (pass@k, pass^k) with a score at least this.")
    ] = PASS_SCORE,
    export: Annotated[
        Path | None,
        typer.Option(help="Also write every rollout as JSON Lines that load as a Hugging Face dataset."),
    ] = None,
    user_model: UserModelOpt = None,
    user_base_url: UserBaseUrlOpt = None,
    user_temperature: UserTemperatureOpt = DEFAULT_TEMPERATURE,
    user_max_steps: UserMaxStepsOpt = DEFAULT_MAX_STEPS,
) -> None:
    """Run a model over a dataset through sparring's tools and grader: rewards, pass@k, items without
    signal."""
    if api not in APIS:
        raise fail(f"--api must be one of {', '.join(APIS)}")
    if resume and run is None:
        raise fail("--resume needs the --run label of the run to continue")
    lines = _lines(dataset)
    target = _target(server, job_config, grader, grader_url, pack)
    chosen = _Model(
        api="responses" if api == "responses" else "chat",
        name=model,
        api_key=_model_api_key(api_key_env, base_url),
        key_env=api_key_env,
        base_url=base_url,
        deadline_s=model_timeout,
        max_answer_bytes=model_max_bytes,
    )
    user = _user_spec(user_model, user_base_url, user_temperature, user_max_steps, model_timeout)
    label = _run_label(run, "eval")
    settings = load_settings()
    journal = journal_path(settings.home, label)
    # A run started again under its label (no --resume) reports only its own rollouts: so does its export.
    before = 0 if resume else len(Journal(journal).load())
    with command_tracing(settings, model=model, warn=_warn) as tracing:
        options = _run_options(
            label, samples, concurrency, max_turns, max_tool_calls, journal=journal, resume=resume
        )
        options.tracing = tracing
        options.pass_threshold = pass_threshold
        options.model = model
        report = _run(lambda stop: _evaluate(chosen, target, lines, options, stop, user))
    typer.echo(format_report(report))
    _write_json(out, report)
    if export is not None:
        records = latest_per_rollout(Journal(journal).load()[before:])
        count = write_export(records, export, run=label, model=model, pass_threshold=pass_threshold)
        typer.echo(f"exported {count} rollouts to {export}")
    if report["interrupted"]:
        raise typer.Exit(130)
    rollouts = report["rollouts"]
    _exit_on_discards(rollouts["run"], rollouts["graded"], rollouts["discarded"], max_discarded)


def _exit_on_discards(run: int, graded: int, discarded: int, max_discarded: float | None) -> None:
    """Exit 1 (after the report) when nothing could be graded or too many rollouts were discarded."""
    verdict = discard_verdict(run, graded, discarded, max_discarded)
    if verdict is not None:
        sys.stdout.flush()
        raise fail(verdict, 1)


@dataclass(frozen=True)
class _Model:
    """The model an eval runs: its API, name and endpoint, and the bounds on each of its turns."""

    api: Api
    name: str
    api_key: str
    key_env: str  # the variable the key came from, named when the endpoint refuses it
    base_url: str | None
    deadline_s: float
    max_answer_bytes: int


@dataclass(frozen=True)
class _User:
    """The model that plays the simulated user: its endpoint, sampling and limits."""

    name: str
    api_key: str
    key_env: str
    base_url: str | None
    temperature: float
    max_steps: int
    deadline_s: float


def _user_spec(
    name: str | None, base_url: str | None, temperature: float, max_steps: int, deadline_s: float
) -> _User | None:
    """The simulated user the flags ask for (None without --user-model), its key from the environment."""
    if name is None:
        if base_url is not None:
            raise fail("--user-base-url needs --user-model")
        return None
    key_env = next((env for env in USER_KEY_ENVS if environment_secret(env) is not None), USER_KEY_ENVS[0])
    return _User(
        name=name,
        api_key=_model_api_key(key_env, base_url),
        key_env=key_env,
        base_url=base_url,
        temperature=temperature,
        max_steps=max_steps,
        deadline_s=deadline_s,
    )


@contextlib.asynccontextmanager
async def _simulated_user(user: _User | None, max_answer_bytes: int) -> AsyncIterator[SimulatedUser | None]:
    """The run's simulated user on its own client, its model checked by one cheap turn first."""
    if user is None:
        yield None
        return
    client = model_client(user.api_key, user.base_url, max_answer_bytes=max_answer_bytes)
    try:
        policy = DeadlinePolicy(ChatPolicy(client, user.name, temperature=user.temperature), user.deadline_s)
        try:
            await check_model(DeadlinePolicy(policy, min(user.deadline_s, PREFLIGHT_DEADLINE_S)))
        except ModelFailure as exc:
            where = user.base_url or "OpenAI's own API"
            hint = f"--user-base-url ({where}, chat completions), --user-model, and the key in {user.key_env}"
            message = f"the user model failed its pre-flight call ({user.name}): {exc}"
            raise fail(f"{message}\n  check: {hint}") from exc
        yield SimulatedUser(model=policy, name=user.name, max_steps=user.max_steps)
    finally:
        await client.close()


async def _evaluate(
    model: _Model,
    target: Target,
    lines: list[DatasetLine],
    options: RunOptions,
    stop: asyncio.Event,
    user: _User | None = None,
) -> dict[str, Any]:
    """Pre-flight the target, then run `model` over `lines` (with the simulated `user`): the run's report."""
    openai_client = model_client(model.api_key, model.base_url, max_answer_bytes=model.max_answer_bytes)
    async with (
        AiohttpTransport.open(options.concurrency) as client,
        _simulated_user(user, model.max_answer_bytes) as options.user,
    ):
        try:
            await _preflight(client, target, lines)
        except TargetError as exc:
            raise fail(str(exc)) from exc
        try:
            await _check_model(model, openai_client)
            return await evaluate(
                client,
                target,
                lines,
                lambda: make_policy(model.api, openai_client, model.name, deadline_s=model.deadline_s),
                options,
                stop=stop,
            )
        finally:
            await openai_client.close()


async def _check_model(model: _Model, openai_client: AsyncOpenAI) -> None:
    """One cheap model turn before the run: a failure stops it (exit 2) with the error and what to check,
    instead of discarding every rollout for the same reason."""
    deadline = min(model.deadline_s, PREFLIGHT_DEADLINE_S)
    try:
        await check_model(make_policy(model.api, openai_client, model.name, deadline_s=deadline))
    except ModelFailure as exc:
        hint = what_to_check(exc, api=model.api, base_url=model.base_url, key_env=model.key_env)
        raise fail(f"the model failed its pre-flight call ({model.name}): {exc}\n  check: {hint}") from exc


def _model_api_key(api_key_env: str, base_url: str | None) -> str:
    """The model API key from `api_key_env`; a local server (`base_url`) takes any key when it is unset."""
    api_key = environment_secret(api_key_env)
    if api_key is None:
        if base_url is None:
            raise fail(f"set {api_key_env} (the model API key), or give --base-url for a local server")
        api_key = "unused"  # local servers take any key; the SDK needs one
    return api_key


def _run_label(run: str | None, prefix: str) -> str:
    """The --run label, or a new one with `prefix`, said on stderr so the run can be resumed or found."""
    label = run or _label(prefix)
    if run is None:
        typer.echo(f"run: {label}", err=True)
    return label


def _run_options(
    label: str,
    samples: int,
    concurrency: int,
    max_turns: int,
    max_tool_calls: int,
    *,
    journal: Path | None = None,
    resume: bool = False,
) -> RunOptions:
    return RunOptions(
        run=label,
        samples=samples,
        concurrency=concurrency,
        limits=EpisodeLimits(max_turns=max_turns, max_tool_calls=max_tool_calls),
        journal=journal,
        resume=resume,
    )


async def _preflight(client: AiohttpTransport, target: Target, lines: list[DatasetLine]) -> None:
    """The target's pre-flight check; its warnings go to stderr, a TargetError stops the run."""
    for warning in await preflight(client, target, lines):
        typer.echo(f"warning: {warning}", err=True)


@runner_cli.command("canary")
def canary_command(
    dataset: DatasetOpt,
    server: ServerOpt = None,
    job_config: JobConfigOpt = None,
    grader: GraderOpt = None,
    grader_url: GraderUrlOpt = None,
    pack: PackOpt = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="Canaries to run (repeat; default all): empty refuse parrot loop guess gold."),
    ] = None,
    threshold: Annotated[
        float, typer.Option(help="Fail when a non-gold canary averages at least this.")
    ] = 0.2,
    run: RunOpt = None,
    samples: Annotated[int, typer.Option(min=1, help="Rollouts per line and canary.")] = 1,
    concurrency: ConcurrencyOpt = 8,
    max_turns: MaxTurnsOpt = 30,
    max_tool_calls: MaxCallsOpt = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
    max_discarded: MaxDiscardedOpt = None,
    user_model: UserModelOpt = None,
    user_base_url: UserBaseUrlOpt = None,
    user_temperature: UserTemperatureOpt = DEFAULT_TEMPERATURE,
    user_max_steps: UserMaxStepsOpt = DEFAULT_MAX_STEPS,
) -> None:
    """Attack the grader with scripted policies; exit 1 when one of them scores (or gold does not)."""
    lines = _lines(dataset)
    target = _target(server, job_config, grader, grader_url, pack)
    user = _user_spec(user_model, user_base_url, user_temperature, user_max_steps, MODEL_DEADLINE_S)
    options = _run_options(_run_label(run, "canary"), samples, concurrency, max_turns, max_tool_calls)

    async def main(stop: asyncio.Event) -> dict[str, Any]:
        async with (
            AiohttpTransport.open(concurrency) as client,
            _simulated_user(user, MODEL_ANSWER_MAX_BYTES) as options.user,
        ):
            try:
                await _preflight(client, target, lines)
                return await run_canaries(
                    client, target, lines, options, policies=policy, threshold=threshold, stop=stop
                )
            except TargetError as exc:
                raise fail(str(exc)) from exc

    with command_tracing(load_settings(), model=None, warn=_warn) as tracing:
        options.tracing = tracing
        report = _run(main)
    if as_json:
        typer.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        typer.echo(format_canaries(report))
    if report["interrupted"]:
        raise typer.Exit(130)
    rows = report["policies"]
    run_count = sum(row["rollouts"] for row in rows)
    graded = sum(row["graded"] for row in rows)
    _exit_on_discards(run_count, graded, run_count - graded, max_discarded)
    if report["failures"]:
        sys.stdout.flush()
        raise typer.Exit(1)
