"""The remote rollout service as the lifespan builds it: the rollout loop on the app's own services."""

from __future__ import annotations

import httpx2
from openai import DEFAULT_CONNECTION_LIMITS, DefaultAsyncHttpxClient

from app.calls.service import ToolCallService
from app.config import Settings
from app.db.session import Database
from app.errors import StartupError
from app.grading.service import GradingService
from app.packs import Registry
from app.remote.egress import EgressRule, GuardedTransport
from app.remote.runner import GatewayStatusLog, RemoteRunner
from app.remote.service import RemoteRolloutService
from app.rollouts.transcripts import DatabaseTranscripts
from app.telemetry import Tracing
from sparring.loop import EpisodeLimits
from sparring.policies import CappedAnswers
from sparring.usersim import SimulatedUser


def build_model_http(settings: Settings) -> DefaultAsyncHttpxClient:
    """One connection pool for every remote rollout's model calls and status logs (the `openai` SDK's
    httpx flavour): every request checked against SPARRING_REMOTE_ALLOWED_HOSTS, every answer capped
    at SPARRING_REMOTE_MODEL_MAX_BYTES, and no redirect followed (each would be a new destination)."""
    connect = httpx2.AsyncHTTPTransport(limits=DEFAULT_CONNECTION_LIMITS)
    guarded = GuardedTransport(connect, EgressRule(settings.remote_allowed_hosts))
    return DefaultAsyncHttpxClient(
        transport=CappedAnswers(guarded, settings.remote_model_max_bytes),
        timeout=settings.remote_model_timeout_seconds,
        follow_redirects=False,
        # Nothing from the environment (proxies, certificates' overrides) changes where requests go.
        trust_env=False,
    )


def build_remote(
    settings: Settings,
    *,
    registry: Registry,
    calls: ToolCallService,
    grading: GradingService,
    database: Database,
    model_http: DefaultAsyncHttpxClient,
    worker: str,
    tracing: Tracing | None = None,
    user: SimulatedUser | None = None,
) -> RemoteRolloutService:
    """StartupError when SPARRING_REMOTE_GRADER names no configured grader. `user` plays the customer
    of rows with a user scenario (SPARRING_USER_MODEL, `app.users.service.build_user`)."""
    if settings.remote_grader is not None and settings.remote_grader not in grading.graders:
        known = ", ".join(sorted(grading.graders)) or "none"
        raise StartupError(
            f"SPARRING_REMOTE_GRADER={settings.remote_grader!r} is not a configured grader (known: {known})"
        )
    runner = RemoteRunner(
        registry=registry,
        calls=calls,
        grading=grading,
        http=model_http,
        grader=settings.remote_grader,
        limits=EpisodeLimits(max_turns=settings.remote_max_turns),
        model_timeout_s=settings.remote_model_timeout_seconds,
        grade_max_bytes=settings.max_body_bytes,
        transcripts=DatabaseTranscripts(database, source="remote"),
        tracing=tracing,
        user=user,
    )
    return RemoteRolloutService(
        database=database,
        execute=runner.execute,
        worker=worker,
        max_concurrent=settings.remote_max_concurrent,
        lease_seconds=settings.remote_lease_seconds,
        retry_after=settings.retry_after_seconds,
        deadline_seconds=settings.remote_deadline_seconds,
        report=GatewayStatusLog(model_http),
        egress=EgressRule(settings.remote_allowed_hosts),
    )
