"""Hooks the relay calls around and after each publish.

``Instrumentation`` is the default: outcome hooks that do nothing, and a publish hook that
opens one OpenTelemetry span per message when a tracer provider is configured (a no-op
otherwise, see `fastapi_outbox.tracing`). ``fastapi_outbox.ops.metrics`` subclasses it for
Prometheus; any subclass can be passed as ``Outbox(..., instrumentation=...)``.

Hooks run on the relay's event loop in the middle of a batch: they must be quick and
must not raise (the relay logs and ignores an exception from a hook).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi_outbox import tracing
from fastapi_outbox.events import Envelope
from fastapi_outbox.tracing import PublishFinisher, PublishOutcome

__all__ = ["Instrumentation", "PublishFinisher", "PublishOutcome"]


def _nothing(outcome: PublishOutcome) -> None:
    return None


class Instrumentation:
    """Default hooks: tracing through OpenTelemetry when configured, nothing else.

    ``tracer_provider``: the provider publish spans are made with (default: the global one;
    no spans while none is set). ``tracing=False`` turns publish spans off.
    """

    tracer_provider: Any = None
    tracing: bool = True

    def __init__(self, *, tracer_provider: Any = None, tracing: bool = True) -> None:
        self.tracer_provider = tracer_provider
        self.tracing = tracing

    def publish_started(self, broker: str, envelopes: Sequence[Envelope]) -> PublishFinisher:
        """``envelopes`` are about to be sent to ``broker``; the returned callable gets the
        outcome. The default opens one span per message, linked to the trace context
        stored with the message at commit."""
        if not self.tracing:
            return _nothing
        return tracing.start_publish_spans(broker, envelopes, self.tracer_provider)

    def published(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        """``envelopes`` were stored by ``broker`` and marked published."""

    def failed(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        """``envelopes`` were refused by ``broker`` and will be retried after a backoff."""

    def abandoned(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        """``envelopes`` were abandoned (attempts exhausted); ``replay`` brings them back."""
