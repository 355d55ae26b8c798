"""Prometheus metrics: counters from the relay, gauges from the table, GET /metrics."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fastapi_outbox import Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.ops.metrics import PrometheusInstrumentation, mount_metrics
from tests.conftest import unique, wait_until


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def publish(outbox: Outbox, stream: str, n: int) -> None:
    async with outbox.unit_of_work() as uow:
        for i in range(n):
            uow.publish(Message(stream=stream, type="Thing", payload={"i": i}))


async def test_metrics_after_publishing(db_url: str) -> None:
    good, bad = unique("orders"), unique("poison")
    broker = MemoryBroker(reject=lambda e: MessageRejected("no") if e.stream == bad else None)
    registry = CollectorRegistry()
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            max_attempts=2,
            retry_base_delay_seconds=0.01,
            retry_max_delay_seconds=0.02,
            retry_jitter=0,
        ),
        instrumentation=PrometheusInstrumentation(registry, refresh_interval_seconds=0),
    )
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)
    mount_metrics(app, outbox)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            await publish(outbox, good, 3)
            await publish(outbox, bad, 1)
            await broker.wait_for(3)
            table_relay = outbox.relays.tables["default"]
            # Counted once marked, which follows the broker's answer: wait for the marks.
            await wait_until(
                lambda: table_relay.abandoned_total == 1 and table_relay.published_total == 3
            )

            response = await client.get("/metrics")
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain")
            m = samples(response.text)
            on = (("broker", "default"),)
            assert (
                m[("outbox_messages_published_total", (("broker", "default"), ("stream", good)))]
                == 3
            )
            assert (
                m[("outbox_messages_failed_total", (("broker", "default"), ("stream", bad)))] == 1
            )
            assert (
                m[("outbox_messages_abandoned_total", (("broker", "default"), ("stream", bad)))]
                == 1
            )
            assert m[("outbox_publish_latency_seconds_count", on)] == 3
            assert 0 < m[("outbox_publish_latency_seconds_sum", on)] < 10
            assert m[("outbox_pending_messages", on)] == 0
            assert m[("outbox_abandoned_messages", on)] == 1
            assert m[("outbox_oldest_pending_age_seconds", on)] == 0
            assert m[("outbox_relay_up", on)] == 1
            assert m[("outbox_database_up", ())] == 1

            # The broker goes away: messages wait, the gauges say so on the next scrape.
            broker.available = False
            await publish(outbox, good, 2)
            await wait_until(lambda: not table_relay.broker_ok)

            async def released() -> bool:  # the claim given back: pending again
                stats = await outbox.store.messages.stats()
                return stats["default"].pending == 2

            await wait_until(released)
            m = samples((await client.get("/metrics")).text)
            assert m[("outbox_pending_messages", on)] == 2
            assert m[("outbox_oldest_pending_age_seconds", on)] > 0
            assert (
                m[("outbox_messages_published_total", (("broker", "default"), ("stream", good)))]
                == 3
            )

            # OpenMetrics for scrapers that ask for it.
            response = await client.get(
                "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
            )
            assert response.headers["content-type"].startswith("application/openmetrics-text")
            assert response.text.rstrip().endswith("# EOF")
    finally:
        await outbox.aclose()


async def test_database_down_does_not_fail_the_scrape() -> None:
    registry = CollectorRegistry()
    outbox = Outbox(
        "postgresql+asyncpg://u:pw@127.0.0.1:1/x",
        settings=OutboxSettings(run_relays=False),
        instrumentation=PrometheusInstrumentation(registry, refresh_interval_seconds=0),
    )
    app = FastAPI()
    mount_metrics(app, outbox)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            response = await client.get("/metrics")
        assert response.status_code == 200
        assert samples(response.text)[("outbox_database_up", ())] == 0
    finally:
        await outbox.aclose()


def test_two_instrumentations_share_a_registry() -> None:
    registry = CollectorRegistry()
    first = PrometheusInstrumentation(registry)
    second = PrometheusInstrumentation(registry)  # no "Duplicated timeseries" error
    assert first.metrics is second.metrics


async def test_stream_label_values_are_bounded(pg_url: str) -> None:
    """Per-tenant stream names made one series per stream, without bound. The first
    ``max_stream_labels`` streams keep their name; the others count under ``other``."""
    registry = CollectorRegistry()
    broker = MemoryBroker()
    outbox = Outbox(
        pg_url,
        brokers={"default": broker},
        instrumentation=PrometheusInstrumentation(
            registry, refresh_interval_seconds=0, max_stream_labels=5
        ),
    )
    await outbox.create_tables()
    tenants = [unique("tenant") for _ in range(40)]
    app = FastAPI(lifespan=outbox.lifespan)
    mount_metrics(app, outbox)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            for stream in tenants:
                await publish(outbox, stream, 2)
            await broker.wait_for(80)
            table_relay = outbox.relays.tables["default"]
            await wait_until(lambda: table_relay.published_total == 80)
            text = (await client.get("/metrics")).text
    finally:
        await outbox.aclose()
    published = {
        dict(labels)["stream"]: value
        for (name, labels), value in samples(text).items()
        if name == "outbox_messages_published_total"
    }
    assert len(published) == 6, published  # 5 names and "other"
    assert sum(published.values()) == 80
    assert published["other"] == 70
