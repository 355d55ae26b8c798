"""W3C trace context for messages, through OpenTelemetry when it is installed and active.

At commit the active span's context (or the request's ``traceparent``) is stored in the
message headers; the dispatcher starts a span per publish linked to it, and ``traceparent``
travels in the broker message's headers. Without ``opentelemetry-api`` these are no-ops
apart from passing a valid incoming ``traceparent`` along.
"""

from __future__ import annotations

from typing import Any

from fastapi_outbox.events import HEADER_TRACEPARENT, HEADER_TRACESTATE


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
