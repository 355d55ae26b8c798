"""OpenTelemetry: the request's trace context is stored at commit, travels in the broker
message headers, and every publish gets a span linked to it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from fastapi_outbox import Envelope, Message, MessageRejected, Outbox, OutboxSettings, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.testing import drain
from fastapi_outbox.tracing import start_publish_spans
from tests.conftest import unique


@pytest.fixture
def tracing() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


async def test_publish_span_linked_to_the_committing_span(
    db_url: str, tracing: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = tracing
    stream, poison = unique("orders"), unique("poison")
    broker = MemoryBroker(reject=lambda e: MessageRejected("no") if e.stream == poison else None)
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(run_relays=False, retry_base_delay_seconds=60),
        instrumentation=Instrumentation(tracer_provider=provider),
    )
    await outbox.create_tables()
    tracer = provider.get_tracer("test")
    try:
        with tracer.start_as_current_span("POST /orders") as request_span:
            async with outbox.unit_of_work() as uow:
                ok_id = uow.publish(Message(stream=stream, type="OrderPlaced", payload={"n": 1}))
                bad_id = uow.publish(Message(stream=poison, type="Bad", payload={"n": 2}))
        request = request_span.get_span_context()
        assert await drain(outbox) == 1

        [envelope] = broker.messages
        # The stored creation context travels to the broker.
        version, trace_id, span_id, _flags = envelope.headers["traceparent"].split("-")
        assert (version, int(trace_id, 16), int(span_id, 16)) == (
            "00",
            request.trace_id,
            request.span_id,
        )

        spans = {
            s.attributes["messaging.message.id"]: s
            for s in exporter.get_finished_spans()
            if s.name.startswith("publish")
        }
        assert set(spans) == {str(ok_id), str(bad_id)}
        ok = spans[str(ok_id)]
        assert ok.name == f"publish {stream}"
        assert ok.kind == SpanKind.PRODUCER
        assert ok.attributes["messaging.destination.name"] == stream
        assert ok.attributes["outbox.broker"] == "default"
        assert ok.status.status_code != StatusCode.ERROR
        [link] = ok.links
        assert (link.context.trace_id, link.context.span_id) == (request.trace_id, request.span_id)
        assert ok.parent is None  # a trace of its own, tied to the request by the link

        bad = spans[str(bad_id)]
        assert bad.status.status_code == StatusCode.ERROR
        assert bad.attributes["error.type"] == "MessageRejected"
        assert bad.links[0].context.trace_id == request.trace_id
    finally:
        await outbox.aclose()


async def test_incoming_traceparent_without_active_span(
    sqlite_url: str, tracing: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """No OpenTelemetry span in the app: the request's ``traceparent`` header is stored,
    sent, and linked."""
    provider, exporter = tracing
    stream = unique("orders")
    broker = MemoryBroker()
    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker},
        instrumentation=Instrumentation(tracer_provider=provider),
    )
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders")
    async def place(uow: UnitOfWorkDep) -> dict[str, str]:
        uow.publish(Message(stream=stream, type="OrderPlaced", payload={}))
        return {}

    incoming = traceparent(0xABC, 0xDEF)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
        ):
            response = await c.post("/orders", headers={"traceparent": incoming})
            assert response.status_code == 200
            [envelope] = await broker.wait_for(1)
        assert envelope.headers["traceparent"] == incoming
        [span] = [s for s in exporter.get_finished_spans() if s.name == f"publish {stream}"]
        assert (span.links[0].context.trace_id, span.links[0].context.span_id) == (0xABC, 0xDEF)
    finally:
        await outbox.aclose()


def test_no_spans_without_a_configured_provider() -> None:
    """The global provider is the default proxy: publishing costs no span at all."""
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider was set by another test")
    envelope = Envelope(id="1", stream="s", type="T", key=None, payload=b"{}", headers={})
    finish = start_publish_spans("default", [envelope])
    assert finish.__name__ == "_nothing"
    finish([None])
