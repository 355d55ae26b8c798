"""Prometheus metrics (extra ``prometheus``): counters from the relay's hooks, gauges
from the outbox table, and a ``/metrics`` route.

::

    from fastapi_outbox.ops.metrics import PrometheusInstrumentation, mount_metrics

    outbox = Outbox(url, brokers=..., instrumentation=PrometheusInstrumentation())
    app = FastAPI(lifespan=outbox.lifespan)
    mount_metrics(app, outbox)                      # GET /metrics

Metrics (prefix ``outbox_``, change it with ``namespace=``):

* ``messages_published_total``, ``messages_failed_total`` (refused, will be retried) and
  ``messages_abandoned_total``, by ``broker`` and ``stream``: counted by the relays of
  this process. Stream names can grow without bound (a stream per tenant), and every
  label value is a series kept forever: the first ``max_stream_labels`` streams seen keep
  their name, the others are counted under ``stream="other"``;
* ``publish_latency_seconds`` by ``broker``: histogram from the message's ``occurred-at``
  header (set when the event was published on the unit of work, just before commit) to
  the broker's acknowledgement — the commit-to-publish latency;
* ``pending_messages``, ``oldest_pending_age_seconds``, ``abandoned_messages`` by
  ``broker``, ``database_up`` and ``relay_up`` by ``broker``: gauges refreshed from
  `Messages.stats` when ``/metrics`` is scraped (at most once per
  ``refresh_interval_seconds``), so they describe the whole table, whichever process
  dispatches it.

Multi-tenant outboxes (``Outbox(tenants=...)``) add, with a ``tenant`` label bounded like
the streams' (the first ``max_tenant_labels`` tenants seen keep their id, the others are
counted under ``tenant="other"``):

* ``tenant_messages_published_total`` by ``broker`` and ``tenant``;
* ``tenant_up`` by ``tenant``: 1 while the relay's last claim in the tenant's database
  answered (refreshed when ``/metrics`` is scraped).

The hooks inherit `Instrumentation`'s publish spans: metrics and traces together.
"""

from __future__ import annotations

import datetime as dt
import time
import weakref
from collections import Counter as Tally
from collections.abc import Sequence
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response

from fastapi_outbox import exceptions
from fastapi_outbox.events import HEADER_OCCURRED_AT, HEADER_TENANT, Envelope
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.lifecycle.tenants import Tenants
from fastapi_outbox.ops.port import OutboxPort, relay_here, tenants_of
from fastapi_outbox.storage.wal_slot import WalSlot

__all__ = ["PrometheusInstrumentation", "metrics_router", "mount_metrics"]

#: Commit-to-publish latency buckets: milliseconds with wake-ups, seconds with polling or
#: backoff, minutes when a broker was down.
LATENCY_BUCKETS_SECONDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
REFRESH_INTERVAL_SECONDS = 1.0
#: Distinct ``stream`` label values (per registry and namespace); later streams: "other".
MAX_STREAM_LABELS = 100
#: Tenants with a label value of their own; the others are counted under "other".
MAX_TENANT_LABELS = 100
#: The ``stream`` label of the streams past ``max_stream_labels``.
OTHER_STREAMS = "other"
REFRESH_TIMEOUT_SECONDS = 5.0


class _Metrics:
    """The collectors of one (registry, namespace): registered once, shared by every
    instrumentation object using them (a second Outbox in the process, tests)."""

    def __init__(self, registry: Any, namespace: str, buckets: Sequence[float]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        #: The streams with a label value of their own (the first ones seen).
        self.streams: set[str] = set()
        #: The tenants with a label value of their own (the first ones seen).
        self.tenants: set[str] = set()

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["broker", "stream"], namespace=namespace, registry=registry)

        def gauge(name: str, doc: str, labels: Sequence[str] = ("broker",)) -> Any:
            return Gauge(name, doc, list(labels), namespace=namespace, registry=registry)

        self.published = counter("messages_published", "Messages published to a broker.")
        self.failed = counter("messages_failed", "Publishes refused; retried after a backoff.")
        self.abandoned = counter("messages_abandoned", "Messages abandoned (attempts exhausted).")
        self.latency = Histogram(
            "publish_latency_seconds",
            "From the message's occurred-at header (commit) to its publish.",
            ["broker"],
            namespace=namespace,
            registry=registry,
            buckets=list(buckets),
        )
        self.pending = gauge("pending_messages", "Messages waiting for their first publish.")
        self.oldest_age = gauge(
            "oldest_pending_age_seconds", "Age of the oldest pending message (0: none)."
        )
        self.abandoned_now = gauge("abandoned_messages", "Abandoned messages in the table.")
        self.relay_up = gauge("relay_up", "1 while this process runs the broker's relay.")
        self.database_up = gauge("database_up", "1 when the last refresh reached the database.", ())
        self.tenant_published = Counter(
            "tenant_messages_published",
            "Messages published to a broker, by tenant (multi-tenant outboxes).",
            ["broker", "tenant"],
            namespace=namespace,
            registry=registry,
        )
        self.tenant_up = gauge(
            "tenant_up",
            "1 while the relay's last claim in the tenant's database answered.",
            ("tenant",),
        )
        # capture="wal": the replication slot.
        self.wal_lag_bytes = gauge(
            "wal_lag_bytes", "WAL written since the slot's confirmed position.", ("slot",)
        )
        self.wal_retained_bytes = gauge(
            "wal_retained_bytes", "WAL the slot keeps from being recycled.", ("slot",)
        )
        self.wal_lag_seconds = gauge(
            "wal_lag_seconds",
            "Age of the oldest message read from the slot and not confirmed (reader here).",
            ("slot",),
        )
        self.wal_slot_lost = gauge(
            "wal_slot_lost",
            "1 when the slot is missing or invalidated (wal_status=lost).",
            ("slot",),
        )


_REGISTRIES: weakref.WeakKeyDictionary[Any, dict[str, _Metrics]] = weakref.WeakKeyDictionary()


def _metrics_for(registry: Any, namespace: str, buckets: Sequence[float]) -> _Metrics:
    by_namespace = _REGISTRIES.setdefault(registry, {})
    if namespace not in by_namespace:
        by_namespace[namespace] = _Metrics(registry, namespace, buckets)
    return by_namespace[namespace]


class PrometheusInstrumentation(Instrumentation):
    """Relay hooks feeding Prometheus collectors on ``registry`` (default: the
    global ``prometheus_client.REGISTRY``)."""

    def __init__(
        self,
        registry: Any = None,
        *,
        namespace: str = "outbox",
        latency_buckets: Sequence[float] = LATENCY_BUCKETS_SECONDS,
        refresh_interval_seconds: float = REFRESH_INTERVAL_SECONDS,
        tracer_provider: Any = None,
        tracing: bool = True,
        max_stream_labels: int = MAX_STREAM_LABELS,
        max_tenant_labels: int = MAX_TENANT_LABELS,
    ) -> None:
        super().__init__(tracer_provider=tracer_provider, tracing=tracing)
        if max_stream_labels < 0:
            raise exceptions.ConfigurationError(
                f"PrometheusInstrumentation max_stream_labels must be >= 0, not {max_stream_labels}"
            )
        self.max_stream_labels = max_stream_labels
        self.max_tenant_labels = max_tenant_labels
        try:
            import prometheus_client
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise exceptions.ConfigurationError(
                "PrometheusInstrumentation needs prometheus-client: "
                "pip install 'fastapi-outbox[prometheus]'"
            ) from exc
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self.metrics = _metrics_for(self.registry, namespace, latency_buckets)
        self.refresh_interval_seconds = refresh_interval_seconds
        self._refreshed_at: float | None = None
        self._refresh_lock = anyio.Lock()

    # -- relay hooks (hot path: one label lookup per stream and batch) --------------------

    def _label(self, stream: str) -> str:
        """``stream``'s label value: its name while the bound allows, else "other"."""
        seen = self.metrics.streams
        if stream in seen:
            return stream
        if len(seen) < self.max_stream_labels and stream != OTHER_STREAMS:
            seen.add(stream)
            return stream
        return OTHER_STREAMS

    def _tenant_label(self, tenant: str) -> str:
        """``tenant``'s label value: its id while the bound allows, else "other"."""
        seen = self.metrics.tenants
        if tenant in seen:
            return tenant
        if len(seen) < self.max_tenant_labels and tenant != OTHER_STREAMS:
            seen.add(tenant)
            return tenant
        return OTHER_STREAMS

    def _by_stream(self, envelopes: Sequence[Envelope]) -> dict[str, int]:
        tally: Tally[str] = Tally()
        for stream, n in Tally(e.stream for e in envelopes).items():
            tally[self._label(stream)] += n
        return tally

    def published(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        m = self.metrics
        for stream, n in self._by_stream(envelopes).items():
            m.published.labels(broker, stream).inc(n)
        histogram = m.latency.labels(broker)
        now = time.time()
        tenants: Tally[str] = Tally()
        for envelope in envelopes:
            tenant = envelope.headers.get(HEADER_TENANT)
            if tenant is not None:
                tenants[tenant] += 1
            occurred = envelope.headers.get(HEADER_OCCURRED_AT)
            if not occurred:
                continue
            try:
                at = dt.datetime.fromisoformat(occurred).timestamp()
            except ValueError:
                continue
            histogram.observe(max(0.0, now - at))
        for tenant, n in tenants.items():
            m.tenant_published.labels(broker, self._tenant_label(tenant)).inc(n)

    def failed(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        for stream, n in self._by_stream(envelopes).items():
            self.metrics.failed.labels(broker, stream).inc(n)

    def abandoned(self, broker: str, envelopes: Sequence[Envelope]) -> None:
        for stream, n in self._by_stream(envelopes).items():
            self.metrics.abandoned.labels(broker, stream).inc(n)

    # -- gauges ------------------------------------------------------------------------------

    async def refresh(self, outbox: OutboxPort, *, force: bool = False) -> None:
        """Set the gauges from the table (cached for ``refresh_interval_seconds``). A
        database that cannot be reached sets ``database_up`` to 0 and keeps the last
        values: a scrape never fails because of it."""
        async with self._refresh_lock:
            now = time.monotonic()
            if (
                not force
                and self._refreshed_at is not None
                and now - self._refreshed_at < self.refresh_interval_seconds
            ):
                return
            m = self.metrics
            tenants = tenants_of(outbox)
            if tenants is not None:
                self._refresh_tenants(outbox, tenants)
                self._refreshed_at = time.monotonic()
                return
            for name in outbox.all_brokers:
                relay = relay_here(outbox, name)
                m.relay_up.labels(name).set(1 if relay and relay.running else 0)
            try:
                with anyio.fail_after(REFRESH_TIMEOUT_SECONDS):
                    stats = await outbox.store.messages.stats(
                        outbox.all_brokers, ordered=outbox.settings.ordered
                    )
            except Exception:
                m.database_up.set(0)
            else:
                m.database_up.set(1)
                for name, s in stats.items():
                    m.pending.labels(name).set(s.pending)
                    m.oldest_age.labels(name).set(s.oldest_pending_age_seconds or 0.0)
                    m.abandoned_now.labels(name).set(s.abandoned)
            if outbox.wal_slot is not None:
                await self._refresh_wal(outbox, outbox.wal_slot)
            self._refreshed_at = time.monotonic()

    def _refresh_tenants(self, outbox: OutboxPort, tenants: Tenants) -> None:
        """A multi-tenant outbox: ``relay_up`` from the one relay of every tenant,
        ``tenant_up`` from its last claim in each tenant's database."""
        m = self.metrics
        relay = tenants.relay
        running = outbox.lifecycle.started and relay.running
        for name in outbox.all_brokers:
            m.relay_up.labels(name).set(1 if running else 0)
        if not running:
            return
        down: Tally[str] = Tally()
        for name in tenants.names:
            label = self._tenant_label(name)
            down[label] += 0 if relay.status(name)["ok"] else 1
        for label, failing in down.items():
            m.tenant_up.labels(label).set(0 if failing else 1)

    async def _refresh_wal(self, outbox: OutboxPort, slot: WalSlot) -> None:
        m = self.metrics
        relay = outbox.relays.wal
        if relay is not None and relay.leader:
            m.wal_lag_seconds.labels(slot.name).set(relay.lag_seconds)
        try:
            with anyio.fail_after(REFRESH_TIMEOUT_SECONDS):
                stats = await slot.stats()
        except Exception:
            return
        m.wal_slot_lost.labels(slot.name).set(1 if stats is None or stats.lost else 0)
        if stats is not None:
            m.wal_lag_bytes.labels(slot.name).set(stats.lag_bytes or 0)
            m.wal_retained_bytes.labels(slot.name).set(stats.retained_bytes or 0)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition of the registry and its content type (OpenMetrics when the
        scraper asks for it)."""
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _instrumentation_of(outbox: OutboxPort) -> PrometheusInstrumentation:
    instrumentation = outbox.instrumentation
    if not isinstance(instrumentation, PrometheusInstrumentation):
        raise exceptions.ConfigurationError(
            "metrics need Outbox(..., instrumentation=PrometheusInstrumentation()); this "
            f"Outbox has {type(instrumentation).__name__}"
        )
    return instrumentation


def metrics_router(outbox: OutboxPort, *, path: str = "/metrics") -> APIRouter:
    """An ``APIRouter`` serving the Prometheus exposition at ``path`` (not in the OpenAPI
    schema)."""
    instrumentation = _instrumentation_of(outbox)
    router = APIRouter(tags=["outbox"])

    @router.get(path, include_in_schema=False)
    async def metrics(request: Request) -> Response:
        await instrumentation.refresh(outbox)
        body, content_type = instrumentation.render(request.headers.get("accept"))
        return Response(content=body, media_type=content_type)

    return router


def mount_metrics(app: Any, outbox: OutboxPort, *, path: str = "/metrics") -> None:
    """``app.include_router(metrics_router(outbox, path=path))``."""
    app.include_router(metrics_router(outbox, path=path))
