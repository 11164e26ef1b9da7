"""The grading service as the server (and `sparring grade`/`regrade`) builds it from the settings."""

from __future__ import annotations

from collections.abc import Collection

from app.config import Settings
from app.db.session import Database
from app.errors import StartupError
from app.grading.graders.model import Grader, GraderConfigError
from app.grading.graders.registry import GraderContext, build_graders, load_graders_file
from app.grading.service import GradingService
from app.metrics import Metrics
from app.packs import Registry
from app.rollouts.store import RolloutStore
from app.telemetry import Tracing


def build_grader_set(settings: Settings, context: GraderContext) -> dict[str, Grader]:
    """The graders of SPARRING_GRADERS_FILE plus the packs' state checks; a bad config stops start-up."""
    try:
        configs = load_graders_file(settings.graders_file) if settings.graders_file is not None else {}
        source = str(settings.graders_file) if settings.graders_file is not None else "SPARRING_GRADERS_FILE"
        return build_graders(configs, source=source, context=context)
    except GraderConfigError as exc:
        raise StartupError(f"invalid grader config (SPARRING_GRADERS_FILE): {exc}") from None


def build_grading(
    settings: Settings,
    registry: Registry,
    context: GraderContext,
    *,
    store: RolloutStore,
    database: Database,
    metrics: Metrics,
    tracing: Tracing | None = None,
) -> GradingService:
    """The grading service the server (and `sparring grade`/`regrade`) uses; StartupError on a bad config."""
    graders = build_grader_set(settings, context)
    return GradingService(
        graders=graders,
        default=default_grader(settings, graders, registry.state_checks),
        store=store,
        database=database,
        metrics=metrics,
        retry_after=settings.retry_after_seconds,
        state_tools=sorted(
            {
                name
                for tools in registry.pack_tools.values()
                for name, spec in tools.items()
                if spec.context_param or spec.mutates
            }
        ),
        tracing=tracing,
    )


def default_grader(
    settings: Settings, graders: Collection[str], state_checks: Collection[str] = ()
) -> str | None:
    """SPARRING_DEFAULT_GRADER, else the file's only grader, else the only grader of all."""
    if settings.default_grader is not None:
        if settings.default_grader not in graders:
            known = ", ".join(sorted(graders)) or "none"
            raise StartupError(
                f"SPARRING_DEFAULT_GRADER={settings.default_grader!r} is not a configured grader "
                f"(known: {known})"
            )
        return settings.default_grader
    configured = [name for name in graders if name not in state_checks]
    if len(configured) == 1:
        return configured[0]
    return next(iter(graders)) if len(graders) == 1 else None
