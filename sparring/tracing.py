"""Spans of the rollout loop (OpenTelemetry GenAI conventions), when `opentelemetry-api` is installed.

The client takes no OpenTelemetry dependency: without the API package (or without a tracer given to
`run_rollout`), nothing here does anything. With one, a rollout is an `invoke_agent` span and each
model turn a `chat <model>` child; the tool calls and the grade are spans of the server that answers
them, made children of the rollout by the W3C `traceparent` the HTTP callers send (`inject_context`),
or by the context itself when the loop runs inside the server (remote rollouts).

The attribute names follow the GenAI semantic conventions at the version `SEMCONV_VERSION` names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

try:
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace

    HAVE_OPENTELEMETRY = True
except ImportError:  # the client installed without opentelemetry-api: no spans
    HAVE_OPENTELEMETRY = False

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

SEMCONV_VERSION = "1.41.0"
"""The OpenTelemetry semantic conventions the attribute names follow: v1.41.0, the last release holding
the GenAI conventions (status "Development") before they moved to their own repository."""
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"

# Attribute names (GenAI semantic conventions, and sparring's own under `sparring.`).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
CONVERSATION = "gen_ai.conversation.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"
RUN = "sparring.run"
CANARY = "sparring.canary"
SCORE = "sparring.grade.score"

AttributeValue = str | bool | int | float


@dataclass(frozen=True)
class RolloutTracing:
    """How the rollouts of a run are traced: the tracer, the model (for `chat <model>` spans and
    `gen_ai.request.model`), its provider (`gen_ai.provider.name`), and attributes every rollout
    span carries (the run label)."""

    tracer: Tracer
    model: str | None = None
    provider: str | None = None
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)

    def labelled(self, **attributes: AttributeValue) -> RolloutTracing:
        """The same, with more attributes on each rollout span (e.g. `{"sparring.run": label}`)."""
        return replace(self, attributes={**self.attributes, **attributes})

    def _model_attributes(self, operation: str, trace_id: str) -> dict[str, AttributeValue]:
        attributes: dict[str, AttributeValue] = {OPERATION: operation, CONVERSATION: trace_id}
        if self.provider:
            attributes[PROVIDER] = self.provider
        if self.model:
            attributes[REQUEST_MODEL] = self.model
        return attributes

    @contextlib.contextmanager
    def rollout(self, trace_id: str) -> Iterator[Span]:
        """The rollout's `invoke_agent` span, current while the rollout runs (its calls nest under it)."""
        attributes = {**self._model_attributes("invoke_agent", trace_id), **self.attributes}
        with self.tracer.start_as_current_span(
            "invoke_agent", kind=otel_trace.SpanKind.INTERNAL, attributes=attributes
        ) as span:
            yield span

    @contextlib.contextmanager
    def chat(self, trace_id: str) -> Iterator[Span]:
        """One model turn: `chat <model>`, a child of the rollout span."""
        name = f"chat {self.model}" if self.model else "chat"
        with self.tracer.start_as_current_span(
            name, kind=otel_trace.SpanKind.CLIENT, attributes=self._model_attributes("chat", trace_id)
        ) as span:
            yield span


def record_usage(span: Span, input_tokens: int, output_tokens: int) -> None:
    """Token usage, when the model's answers reported any."""
    if input_tokens or output_tokens:
        span.set_attribute(INPUT_TOKENS, input_tokens)
        span.set_attribute(OUTPUT_TOKENS, output_tokens)


def record_rollout(
    span: Span, *, ended_by: str, tool_calls: int, score: float | None, discarded: str | None
) -> None:
    """How the rollout ended: its score, and `error.type` (with an error status) when it was discarded."""
    span.set_attribute("sparring.rollout.ended_by", ended_by)
    span.set_attribute("sparring.rollout.tool_calls", tool_calls)
    if score is not None:
        span.set_attribute(SCORE, score)
    if discarded is not None:
        # `model_error`, `tool_failed` or `grader_failed`: the reason's first word, a small vocabulary.
        kind = discarded.split(":", 1)[0]
        span.set_attribute(ERROR_TYPE, kind)
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, kind))


def mark_failed(span: Span, exc: BaseException) -> None:
    """A span whose operation raised: `error.type` is the exception's class, the status an error."""
    span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
    span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, type(exc).__qualname__))


def inject_context(headers: MutableMapping[str, str]) -> None:
    """Add the current span's W3C `traceparent` (and `tracestate`) to `headers`, when there is one."""
    if HAVE_OPENTELEMETRY and otel_trace.get_current_span().get_span_context().is_valid:
        otel_propagate.inject(headers)
