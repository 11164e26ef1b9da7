"""One `sparring eval` or `sparring canary` run: where sparring is, preflight checks, the run, its report.

`Target` says where the tools and the grader are (one server, or a job config) with their headers;
`evaluate` runs a model policy over a dataset and returns the report; `run_canaries` runs the
scripted canaries and returns their verdict. Both take the transport to use (or an
`httpx.AsyncClient`), so they run the same against a deployed server and an in-process app.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote, unquote, urlsplit

import httpx

from sparring.canaries import Canary, all_canaries, gold_calls
from sparring.conversation import HttpTranscripts
from sparring.evaluate import (
    FinishedRollout,
    Job,
    Journal,
    Progress,
    graded_keys,
    latest_per_rollout,
    plan_jobs,
    run_jobs,
)
from sparring.http import (
    Endpoint,
    HttpGrader,
    HttpToolCaller,
    Retry,
    ToolEndpoints,
    Transport,
    TransportError,
    as_transport,
    fill_placeholders,
    headers_of,
)
from sparring.loop import DatasetLine, EpisodeLimits, Policy, function_of
from sparring.report import PASS_SCORE, build_report, canary_report
from sparring.tracing import CANARY, RUN, RolloutTracing
from sparring.usersim import HttpUserTools, SimulatedUser


class TargetError(ValueError):
    """The run cannot start: a bad key, an unknown grader, a job config without what is needed."""


@dataclass(frozen=True)
class Target:
    """Where a run sends tool calls and grades, and where the run's review page is."""

    tools: ToolEndpoints
    grader: Endpoint
    server: str | None = None  # base URL of one sparring server (preflight checks and review links)
    pack: str | None = (
        None  # the server's pack whose tools the lines call, at its routes (None: /tools/<name>)
    )

    @property
    def grader_name(self) -> str:
        """The grader's name (the last part of a `/grade/<name>` URL), else its URL."""
        path = urlsplit(self.grader.url).path.rstrip("/")
        head, _, name = path.rpartition("/")
        return unquote(name) if head.endswith("/grade") and name else self.grader.url

    def transcripts(
        self, client: Transport | httpx.AsyncClient, *, model: str | None, source: str
    ) -> HttpTranscripts | None:
        """Where the rollouts' conversations are kept: the server's transcript route, with the grader's
        headers (None when the run has no sparring server)."""
        if self.server is None:
            return None
        endpoint = Endpoint(url=self.server, headers=self.grader.headers)
        return HttpTranscripts(client, endpoint, model=model, source=source)

    def review_url(self, run: str) -> str | None:
        return f"{self.server}/review/run?name={quote(run, safe='')}" if self.server else None


def auth_headers(header: str, key: str | None) -> dict[str, str]:
    if key is None:
        return {}
    return {"Authorization": f"Bearer {key}"} if header.lower() == "authorization" else {header: key}


def server_target(
    server: str,
    *,
    tools_key: str | None,
    grader_key: str | None,
    grader: str | None = None,
    grader_url: str | None = None,
    auth_header: str = "Authorization",
    pack: str | None = None,
) -> Target:
    """One server's tools and grader; with `pack`, that pack's tools at its routes
    (`/packs/<pack>/tools/<name>`), the names it shares with other enabled packs included."""
    base = server.rstrip("/")
    url = grader_url or (f"{base}/grade/{quote(grader, safe='')}" if grader else f"{base}/grade")
    return Target(
        tools=ToolEndpoints.for_server(base, auth_headers(auth_header, tools_key), pack),
        grader=Endpoint(url=url, headers=auth_headers(auth_header, grader_key)),
        server=base,
        pack=pack,
    )


def reinforcement_of(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The tools and grader of a job config: OpenAI's `method.reinforcement` block as it is, or the block
    inside Foundry's whole job (what `sparring job-config` prints by default)."""
    job = config.get("job")
    method = job.get("method") if isinstance(job, Mapping) else None
    block = method.get("reinforcement") if isinstance(method, Mapping) else None
    return block if isinstance(block, Mapping) else config


def job_config_target(
    config: Mapping[str, Any],
    secrets: Mapping[str, str],
    *,
    server: str | None = None,
    grader: str | None = None,
    grader_url: str | None = None,
    grader_headers: Mapping[str, str] | None = None,
) -> Target:
    """Tools (and, unless `--grader`/`--grader-url` says otherwise, the grader) from a job config."""
    config = reinforcement_of(config)
    try:
        tools = ToolEndpoints.from_job_config(config, secrets)
        entry = config.get("grader")
        headers = fill_placeholders(headers_of(entry, "grader"), secrets) if isinstance(entry, dict) else {}
    except ValueError as exc:
        raise TargetError(f"job config: {exc}") from exc
    if grader_url or grader:
        if grader and not grader_url:
            if server is None:
                raise TargetError("--grader NAME needs --server URL (or give --grader-url)")
            grader_url = f"{server.rstrip('/')}/grade/{quote(grader, safe='')}"
        assert grader_url is not None
        return Target(
            tools=tools,
            grader=Endpoint(url=grader_url, headers=dict(grader_headers or headers)),
            server=server.rstrip("/") if server else None,
        )
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
        raise TargetError(
            "the job config has no endpoint grader: give --grader-url or --grader with --server"
        )
    url = entry["url"]
    base = server.rstrip("/") if server else (url.split("/grade", 1)[0] if "/grade" in url else None)
    return Target(tools=tools, grader=Endpoint(url=url, headers=headers), server=base)


async def preflight(
    client: Transport | httpx.AsyncClient, target: Target, lines: Sequence[DatasetLine]
) -> list[str]:
    """Check a server's keys and grader before spending model tokens; return warnings, raise on errors."""
    if target.server is None:
        return []
    warnings: list[str] = []
    probe = target.tools.fallback or next(iter(target.tools.by_name.values()), None)
    tools_headers = probe.headers if probe is not None else {}
    transport = as_transport(client)
    listing = f"{target.server}/tools" + (f"?pack={quote(target.pack, safe='')}" if target.pack else "")
    try:
        listed = await transport.request("GET", listing, content=None, headers=tools_headers, seconds=30)
        graders = await transport.request(
            "GET", f"{target.server}/grade", content=None, headers=target.grader.headers, seconds=30
        )
    except TransportError as exc:
        raise TargetError(f"cannot reach {target.server}: {exc}") from exc
    for response, what, env in (
        (listed, "tools", "SPARRING_TOOLS_KEY"),
        (graders, "grader", "SPARRING_GRADER_KEY"),
    ):
        if response.status in (401, 403):
            raise TargetError(f"{target.server} refused the {what} key (HTTP {response.status}): set {env}")
    if listed.status == 404 and target.pack:
        raise TargetError(f"{target.server} has no enabled pack named {target.pack!r}")
    if listed.status == 200:
        served = {tool.get("name") for tool in listed.json() if isinstance(tool, dict)}
        wanted = {name for line in lines for name in _tool_names(line.tools)}
        missing = sorted(wanted - served)
        if missing and target.tools.by_name == {}:
            absent = ", ".join(missing)
            warnings.append(
                f"pack {target.pack!r} does not serve {absent}: those calls get an error"
                if target.pack
                else f"the server does not serve {absent} at /tools/<name>: those calls get an error (a name "
                "several enabled packs share is served at its pack's route only: pass --pack NAME)"
            )
    if graders.status == 200 and target.grader.url.startswith(f"{target.server}/grade/"):
        name = target.grader.url.rsplit("/", 1)[1]
        names = {g.get("name") for g in graders.json() if isinstance(g, dict)}
        if name not in names:
            raise TargetError(
                f"{target.server} has no grader {name!r} (it has: {', '.join(sorted(map(str, names)))})"
            )
    return warnings


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    names = []
    for tool in tools:
        name = function_of(tool).get("name")
        if isinstance(name, str):
            names.append(name)
    return names


@dataclass
class RunOptions:
    run: str
    samples: int = 1
    concurrency: int = 8
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    retry: Retry = field(default_factory=Retry)
    journal: Path | None = None  # where finished rollouts are recorded (needed for resume)
    resume: bool = False
    tracing: RolloutTracing | None = None  # rollouts as OpenTelemetry spans (sparring.tracing)
    pass_threshold: float = PASS_SCORE  # a rollout passes (pass@k) with a score at least this
    user: SimulatedUser | None = None  # plays the customer of lines with a user scenario (sparring.usersim)
    model: str | None = None  # the model's name, stored with each rollout's conversation


def user_on_target(
    client: Transport | httpx.AsyncClient, target: Target, options: RunOptions, run: str
) -> SimulatedUser | None:
    """The run's simulated user, its own tools called on the target's server (`/user-tools/<name>`,
    with the tool routes' headers); a job config names no such route, so its user has no tools."""
    user = options.user
    if user is None or target.server is None or target.tools.fallback is None:
        return user
    tools = HttpUserTools(
        as_transport(client), target.server, target.tools.fallback.headers, run=run, retry=options.retry
    )
    return replace(user, tools=tools)


async def evaluate(
    client: Transport | httpx.AsyncClient,
    target: Target,
    lines: Sequence[DatasetLine],
    make_policy: Callable[[], Policy],
    options: RunOptions,
    *,
    stop: asyncio.Event | None = None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Run `options.samples` rollouts of every line with the model policy; return the report."""
    started = time.perf_counter()
    journal = Journal(options.journal) if options.journal is not None else None
    earlier = latest_per_rollout(journal.load()) if journal is not None and options.resume else []
    done = graded_keys(earlier)
    kept_earlier = [r for r in earlier if r.graded]
    jobs = [job for job in plan_jobs(lines, options.samples) if (job.policy, job.key, job.sample) not in done]
    planned = len(jobs) + len(kept_earlier)
    tools = HttpToolCaller(client, target.tools, run=options.run, retry=options.retry)
    grader = HttpGrader(client, target.grader, run=options.run, retry=options.retry)
    progress = Progress(len(jobs), stream=progress_stream)
    records: list[FinishedRollout] = []
    policy = make_policy()

    def on_record(record: FinishedRollout) -> None:
        records.append(record)
        if journal is not None:
            journal.append(record)
        progress.add(record)

    try:
        finished = await run_jobs(
            jobs,
            lambda job: policy,
            tools,
            grader,
            limits=options.limits,
            concurrency=options.concurrency,
            on_record=on_record,
            stop=stop,
            tracing=options.tracing.labelled(**{RUN: options.run}) if options.tracing else None,
            user=user_on_target(client, target, options, options.run),
            transcripts=target.transcripts(client, model=options.model, source="eval"),
        )
    finally:
        progress.close()
    return build_report(
        kept_earlier + records,
        run=options.run,
        review_url=target.review_url(options.run),
        planned=planned,
        resumed=len(kept_earlier),
        wall_time_s=time.perf_counter() - started,
        interrupted=not finished,
        pass_threshold=options.pass_threshold,
        user_model=options.user.name if options.user is not None else None,
    )


def canary_limits(limits: EpisodeLimits, job: Job) -> EpisodeLimits:
    """Gold needs a turn per gold call plus the answer, whatever the limits given."""
    if job.policy != "gold":
        return limits
    needed = len(gold_calls(job.line.item))
    return EpisodeLimits(
        max_turns=max(limits.max_turns, needed + 1), max_tool_calls=max(limits.max_tool_calls, needed)
    )


async def run_canaries(
    client: Transport | httpx.AsyncClient,
    target: Target,
    lines: Sequence[DatasetLine],
    options: RunOptions,
    *,
    policies: Sequence[str] | None = None,
    threshold: float = 0.2,
    gold_minimum: float = 0.9,
    stop: asyncio.Event | None = None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Each canary over the lines it applies to, as its own run `<run>-<policy>`; return the verdict."""
    canaries: dict[str, Canary] = all_canaries()
    chosen = list(policies) if policies else list(canaries)
    unknown = [name for name in chosen if name not in canaries]
    if unknown:
        raise TargetError(f"unknown canary {', '.join(unknown)}; the canaries are {', '.join(canaries)}")
    started = time.perf_counter()
    records: list[FinishedRollout] = []
    interrupted = False
    runs: dict[str, str | None] = {}
    for name in chosen:
        canary = canaries[name]
        run = f"{options.run}-{name}"
        runs[name] = target.review_url(run)
        finished = await _run_canary(
            client, target, lines, options, name, canary, records, stop=stop, progress_stream=progress_stream
        )
        if not finished:
            interrupted = True
            break
    report = canary_report(
        records, threshold=threshold, gold_minimum=gold_minimum, policies=chosen, grader=target.grader_name
    )
    report["run"] = options.run
    report["user_model"] = options.user.name if options.user is not None else None
    report["review_urls"] = runs
    report["interrupted"] = interrupted
    report["wall_time_s"] = round(time.perf_counter() - started, 3)
    report["rollouts"] = [
        {
            "policy": r.policy,
            "item": r.item_key,
            "trace_id": r.trace_id,
            "score": r.score,
            "discarded": r.discarded,
        }
        for r in records
    ]
    return report


async def _run_canary(
    client: Transport | httpx.AsyncClient,
    target: Target,
    lines: Sequence[DatasetLine],
    options: RunOptions,
    name: str,
    canary: Canary,
    records: list[FinishedRollout],
    *,
    stop: asyncio.Event | None,
    progress_stream: TextIO | None,
) -> bool:
    """One canary over the lines it applies to, as run `<run>-<name>`, its records appended to
    `records`; False when `stop` interrupted it."""
    run = f"{options.run}-{name}"
    jobs = plan_jobs(lines, options.samples, policy=name, keep=canary.applies)
    if not jobs:
        return True
    progress = Progress(len(jobs), stream=progress_stream, label=f"{name:<7}")
    tools = HttpToolCaller(client, target.tools, run=run, retry=options.retry)
    grader = HttpGrader(client, target.grader, run=run, retry=options.retry)

    def on_record(record: FinishedRollout) -> None:
        records.append(record)
        progress.add(record)

    try:
        finished = await run_jobs(
            jobs,
            lambda job: canary,
            tools,
            grader,
            limits=options.limits,
            concurrency=options.concurrency,
            on_record=on_record,
            stop=stop,
            limits_for=lambda job: canary_limits(options.limits, job),
            tracing=options.tracing.labelled(**{RUN: run, CANARY: name}) if options.tracing else None,
            user=user_on_target(client, target, options, run),
            transcripts=target.transcripts(client, model=f"canary:{name}", source="canary"),
        )
    finally:
        progress.close()
    return finished
