"""Canonical: fastapi_outbox.ops.metrics (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.ops.metrics import PrometheusInstrumentation, metrics_router, mount_metrics

__all__ = ["PrometheusInstrumentation", "metrics_router", "mount_metrics"]
