"""W3C trace context for messages, through OpenTelemetry when it is installed and active.

* At commit, the active span's context (or the request's ``traceparent``) is stored in the
  message headers (`current_trace_headers`, called by the unit of work).
* The stored ``traceparent`` travels unchanged in the broker message's headers: it is the
  message's *creation context* (OpenTelemetry messaging conventions), so a consumer that
  extracts it joins the trace of the request that raised the event.
* The relay opens one ``PRODUCER`` span per message around the broker call
  (`start_publish_spans`), *linked* to that stored context. The publish happens
  after the request has ended, often in another process, so the span starts a trace of
  its own instead of being parented to a finished request; the link ties the two.

Without ``opentelemetry-api``, or while no tracer provider is configured, publishing costs
no span at all and only a valid incoming ``traceparent`` is passed along.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi_outbox.events import (
    HEADER_CORRELATION_ID,
    HEADER_TRACEPARENT,
    HEADER_TRACESTATE,
    Envelope,
)

TRACER_NAME = "fastapi_outbox"

#: What a publish ended with: one result per envelope (None = stored), or the exception
#: that ended the whole call (broker unreachable, timeout, shutdown).
PublishOutcome = Sequence[BaseException | None] | BaseException
#: Called once with the outcome of the publish it was returned for.
PublishFinisher = Callable[[PublishOutcome], None]


def _otel() -> Any:
    try:
        from opentelemetry import propagate, trace
    except ImportError:  # the otel extra is not installed
        return None
    return propagate, trace


def current_trace_headers(fallback_traceparent: str | None = None) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the active span, or the request's."""
    otel = _otel()
    if otel is not None:
        propagate, trace = otel
        span = trace.get_current_span()
        if span.get_span_context().is_valid:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            return {
                k: v for k, v in carrier.items() if k in (HEADER_TRACEPARENT, HEADER_TRACESTATE)
            }
    if fallback_traceparent:
        return {HEADER_TRACEPARENT: fallback_traceparent}
    return {}


def stored_span_context(headers: dict[str, str]) -> Any:
    """The ``SpanContext`` stored in a message's ``traceparent`` header, or None.

    Parsed by hand (version 00: ``00-<32 hex>-<16 hex>-<2 hex>``) rather than through the
    propagator: it runs once per published message."""
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    value = headers.get(HEADER_TRACEPARENT)
    if not value or len(value) != 55:
        return None
    parts = value.split("-")
    if len(parts) != 4 or parts[0] != "00":
        return None
    _, trace_id, span_id, flags = parts
    try:
        tid, sid, fl = int(trace_id, 16), int(span_id, 16), int(flags, 16)
    except ValueError:
        return None
    if not tid or not sid:
        return None
    state = headers.get(HEADER_TRACESTATE)
    return SpanContext(
        trace_id=tid,
        span_id=sid,
        is_remote=True,
        trace_flags=TraceFlags(fl),
        trace_state=TraceState.from_header([state]) if state else None,
    )


def _nothing(outcome: PublishOutcome) -> None:
    return None


def start_publish_spans(
    broker: str, envelopes: Sequence[Envelope], tracer_provider: Any = None
) -> PublishFinisher:
    """Open a ``publish <stream>`` span per envelope; the returned callable ends them with
    the publish outcome (status ERROR and ``error.type`` for a refused message)."""
    otel = _otel()
    if otel is None or not envelopes:
        return _nothing
    _, trace = otel
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return _nothing  # nothing configured: no spans, no per-message cost
    from opentelemetry.context import Context

    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)
    root = Context()
    spans = []
    for envelope in envelopes:
        stored = stored_span_context(envelope.headers)
        attributes: dict[str, Any] = {
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": envelope.stream,
            "messaging.message.id": envelope.id,
            "outbox.broker": broker,
            "outbox.message_type": envelope.type,
        }
        correlation = envelope.headers.get(HEADER_CORRELATION_ID)
        if correlation:
            attributes["messaging.message.conversation_id"] = correlation
        spans.append(
            tracer.start_span(
                f"publish {envelope.stream}",
                context=root,
                kind=trace.SpanKind.PRODUCER,
                attributes=attributes,
                links=[trace.Link(stored)] if stored is not None else None,
            )
        )

    def finish(outcome: PublishOutcome) -> None:
        from opentelemetry.trace import Status, StatusCode

        for index, span in enumerate(spans):
            error = outcome if isinstance(outcome, BaseException) else outcome[index]
            if error is not None:
                # The type only: a broker's error text may quote the message.
                span.set_attribute("error.type", type(error).__name__)
                span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.end()

    return finish
