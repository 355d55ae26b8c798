"""Hooks the dispatcher calls on outcomes; the default does nothing.

``fastapi_outbox.metrics`` implements them for Prometheus; any object with these methods
can be passed as ``Outbox(..., instrumentation=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi_outbox.events import Envelope


class Instrumentation:
    """No-op hooks: subclass and override what you need."""

    def published(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        """``envelopes`` were stored by ``broker``."""

    def failed(self, broker: str, count: int) -> None:
        """``count`` messages were refused and will be retried."""

    def abandoned(self, broker: str, count: int) -> None:
        """``count`` messages were abandoned."""
