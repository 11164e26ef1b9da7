"""Traces: OpenTelemetry spans of tool calls, grades and rollouts, exported over OTLP/HTTP (protobuf).

Off unless OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (`build_tracing`
gives None, and the call sites' one `is not None` check is all tracing costs). On, the SDK's batch
processor hands spans to its exporter on its own thread: a call never waits for the collector, and a
collector that is down or slow only loses spans, counted in /metrics (`sparring_trace_spans_dropped`).
The SDK reads the other standard variables itself (OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT,
OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*, OTEL_PROPAGATORS).

The spans follow the GenAI semantic conventions at `sparring.tracing.SEMCONV_VERSION`:

- `execute_tool <tool>` per tool call (`Tracing.tool_call`, hooked into `ToolCallService.call`);
- `grade <grader>` per grade (`Tracing.grade`, around `GradingService.grade`);
- `invoke_agent` per remote rollout with `chat <model>` children (`Tracing.rollouts`, given to the loop).

A W3C `traceparent` on an incoming request makes its trace the parent (`TraceParent`, the ASGI layer
`create_app` puts in front of the tool routes, /mcp and the app when tracing is on).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import Settings
from app.errors import StartupError
from sparring.tracing import (
    CONVERSATION,
    ERROR_TYPE,
    OPERATION,
    RUN,
    SCHEMA_URL,
    SCORE,
    AttributeValue,
    RolloutTracing,
)
from sparring.wire import OK, REPLAYED

log = logging.getLogger(__name__)

# Outcomes that end without an answer the model read: nothing to put on the span as the result.
_UNANSWERED = frozenset({"tool_crash", "infra_error"})
_SHUTDOWN_MILLIS = 5_000  # how long shutdown gives the last spans to reach the collector


class _Answered(Protocol):
    @property
    def output(self) -> str | None: ...


class TracedCall(Protocol):
    """What a tool call's span is made of (`app.calls.service._Call` has it)."""

    @property
    def tool(self) -> str: ...
    @property
    def trace_id(self) -> str: ...
    @property
    def call_id(self) -> str | None: ...
    @property
    def run(self) -> str | None: ...
    @property
    def channel(self) -> str: ...
    @property
    def arguments_text(self) -> str: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def replayed(self) -> bool: ...
    @property
    def record(self) -> _Answered | None: ...


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting the spans a failed export lost (the collector down or refusing)."""

    def __init__(self, inner: SpanExporter, dropped: Callable[[int], None]) -> None:
        self.inner = inner
        self.dropped = dropped

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            log.exception("exporting %d spans failed", len(spans))
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.dropped(len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _CountingBatchProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans its full queue pushes out (it drops the oldest)."""

    def __init__(self, exporter: SpanExporter, dropped: Callable[[int], None]) -> None:
        super().__init__(exporter)
        self.dropped = dropped

    def on_end(self, span: ReadableSpan) -> None:
        # The SDK counts these only into its own (opt-in) metrics; its queue is read here instead, an
        # internal of the pinned SDK version that tests/telemetry/test_export_faults.py holds to.
        batch = self._batch_processor
        if len(batch._queue) >= batch._max_queue_size:
            self.dropped(1)
        super().on_end(span)

    def shutdown(self) -> None:
        # The SDK waits up to 30 s for its last export (a collector that does not answer holds it for the
        # exporter's whole timeout): a stopping server gives it a few seconds, then drops what is left.
        self._batch_processor.shutdown(timeout_millis=_SHUTDOWN_MILLIS)


def _resource(settings: Settings) -> Resource:
    """The SDK's resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME), `sparring` when unnamed."""
    resource = Resource.create()
    name = resource.attributes.get(SERVICE_NAME)
    if not isinstance(name, str) or name.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: settings.otel_service_name}))
    return resource


def traces_endpoint(settings: Settings) -> str:
    """Where spans are posted, as the SDK defines it: the traces endpoint as given, else
    `<OTEL_EXPORTER_OTLP_ENDPOINT>/v1/traces`."""
    if settings.otel_exporter_otlp_traces_endpoint:
        return settings.otel_exporter_otlp_traces_endpoint
    return f"{(settings.otel_exporter_otlp_endpoint or '').rstrip('/')}/v1/traces"


def build_provider(settings: Settings, dropped: Callable[[int], None]) -> TracerProvider:
    """A tracer provider exporting in batches to the configured OTLP/HTTP endpoint (never global)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = _CountingExporter(OTLPSpanExporter(endpoint=traces_endpoint(settings)), dropped)
    try:
        processor = _CountingBatchProcessor(exporter, dropped)
    except ValueError as exc:  # the SDK's check of the OTEL_BSP_* sizes it read
        raise StartupError(
            f"tracing: {exc} (OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, "
            "OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_EXPORT_TIMEOUT)"
        ) from exc
    provider = TracerProvider(resource=_resource(settings))
    provider.add_span_processor(processor)
    return provider


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}…[{len(text) - limit} characters cut]"


def _failed(span: Span, error_type: str) -> None:
    span.set_attribute(ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


@dataclass
class Tracing:
    """The server's tracer and what it puts on spans; built by the lifespan when tracing is on."""

    provider: TracerProvider
    content: bool = False  # tool arguments and results on the spans (SPARRING_TRACE_CONTENT)
    content_max_chars: int = 4096
    tracer: Tracer = field(init=False)

    def __post_init__(self) -> None:
        self.tracer = self.provider.get_tracer("sparring", schema_url=SCHEMA_URL)

    def tool_call(self, call: TracedCall, outcome: str) -> None:
        """The `execute_tool` span of a call that just ended, under the current context's span; a
        failure here is logged, never the call's."""
        try:
            self._tool_span(call, outcome)
        except Exception:
            log.exception("tracing: the span of a call to %s was not recorded", call.tool)

    def _tool_span(self, call: TracedCall, outcome: str) -> None:
        outcome_name = REPLAYED if call.replayed and outcome not in _UNANSWERED else outcome
        attributes: dict[str, AttributeValue] = {
            OPERATION: "execute_tool",
            "gen_ai.tool.name": call.tool,
            "gen_ai.tool.type": "function",
            CONVERSATION: call.trace_id,
            "sparring.outcome": outcome_name,
            "sparring.channel": call.channel,
        }
        if call.call_id is not None:
            attributes["gen_ai.tool.call.id"] = call.call_id
        if call.run is not None:
            attributes[RUN] = call.run
        if self.content:
            attributes["gen_ai.tool.call.arguments"] = _cut(call.arguments_text, self.content_max_chars)
            output = call.record.output if call.record is not None else None
            if output is not None and outcome not in _UNANSWERED:
                attributes["gen_ai.tool.call.result"] = _cut(output, self.content_max_chars)
        span = self.tracer.start_span(
            f"execute_tool {call.tool}".rstrip(),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=int(call.started_at.timestamp() * 1e9),
        )
        if outcome != OK:  # a model's mistake included; a replay of an answer that was ok is ok
            _failed(span, outcome)
        span.end()

    @contextlib.contextmanager
    def grade(self, grader: str, trace_id: str | None, run: str | None) -> Iterator[GradeSpan]:
        """The `grade <grader>` span, current while the grade runs; an exception marks it failed."""
        attributes: dict[str, AttributeValue] = {OPERATION: "grade", "sparring.grader": grader}
        if trace_id:
            attributes[CONVERSATION] = trace_id
        if run:
            attributes[RUN] = run
        with self.tracer.start_as_current_span(
            f"grade {grader}", kind=SpanKind.INTERNAL, attributes=attributes, set_status_on_exception=False
        ) as span:
            try:
                yield GradeSpan(span)
            except Exception as exc:
                _failed(span, getattr(exc, "code", None) or type(exc).__qualname__)
                raise

    def rollouts(self, *, model: str | None, provider: str | None = "openai") -> RolloutTracing:
        """How the rollout loop traces the rollouts it runs in this server (remote rollouts)."""
        return RolloutTracing(self.tracer, model=model, provider=provider)

    def shutdown(self) -> None:
        """Send what is queued (for a few seconds at most) and stop the exporter's thread."""
        self.provider.shutdown()


@dataclass(frozen=True)
class GradeSpan:
    span: Span

    def scored(self, score: float, sub_scores: dict[str, float], flags: Sequence[str]) -> None:
        """The grade's score, each sub-score (`sparring.grade.sub_scores.<name>`) and the flags raised."""
        self.span.set_attribute(SCORE, score)
        for name, value in sub_scores.items():
            self.span.set_attribute(f"sparring.grade.sub_scores.{name}", value)
        if flags:
            self.span.set_attribute("sparring.grade.flags", list(flags))


def build_tracing(settings: Settings, dropped: Callable[[int], None]) -> Tracing | None:
    """The server's tracing when an OTLP endpoint is configured, else None (nothing is traced)."""
    if not settings.tracing:
        return None
    return Tracing(
        build_provider(settings, dropped),
        content=settings.trace_content,
        content_max_chars=settings.trace_content_max_chars,
    )


@contextlib.contextmanager
def command_tracing(
    settings: Settings, *, model: str | None, warn: Callable[[str], None]
) -> Iterator[RolloutTracing | None]:
    """`sparring eval` and `canary`: how their rollouts are traced (None when tracing is off); at the end,
    what is queued is sent, and spans that could not be are reported through `warn`."""
    if not settings.tracing:
        yield None
        return
    lost = [0]

    def dropped(count: int) -> None:
        lost[0] += count

    provider = build_provider(settings, dropped)
    try:
        tracer = provider.get_tracer("sparring", schema_url=SCHEMA_URL)
        yield RolloutTracing(tracer, model=model, provider="openai" if model else None)
    finally:
        provider.shutdown()
        if lost[0]:
            warn(f"tracing: {lost[0]} spans could not be sent to the OTLP collector")


_PARENT_HEADERS = (b"traceparent", b"tracestate", b"baggage")


class TraceParent:
    """ASGI: a request's W3C `traceparent` becomes the current context, so its spans join that trace."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope["headers"]
            if key in _PARENT_HEADERS
        }
        if "traceparent" not in carrier:
            await self.app(scope, receive, send)
            return
        token = otel_context.attach(propagate.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)
