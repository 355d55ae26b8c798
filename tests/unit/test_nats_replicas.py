"""``NatsJetStreamBroker(replicas=...)`` without a server: the ``num_replicas`` of the
streams it creates (dead-letter streams included), the refusal of a bad count, and the
warnings: a single-replica stream created on a cluster, an existing stream with fewer
replicas than asked for."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import nats.js.errors
import pytest

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import NatsJetStreamBroker
from fastapi_outbox.brokers.nats.connection import NatsConnection


class FakeJetStream:
    def __init__(self, existing: dict[str, int]) -> None:
        #: stream name (= subject here) -> its replicas
        self.existing = existing
        self.added: list[dict[str, Any]] = []

    async def find_stream_name_by_subject(self, subject: str) -> str:
        if subject not in self.existing:
            raise nats.js.errors.NotFoundError
        return subject

    async def stream_info(self, name: str) -> Any:
        config = SimpleNamespace(duplicate_window=10**9, num_replicas=self.existing[name])
        return SimpleNamespace(config=config)

    async def add_stream(self, **config: Any) -> None:
        self.added.append(config)
        self.existing[config["subjects"][0]] = config["num_replicas"]


class FakeClient:
    def __init__(self, js: FakeJetStream, cluster: str | None) -> None:
        self.js = js
        self._server_info: dict[str, Any] = {"version": "2.9.10"}
        if cluster is not None:
            self._server_info["cluster"] = cluster
        self.is_connected = True

    def jetstream(self, timeout: float) -> FakeJetStream:
        return self.js


def test_replicas_reach_every_stream_it_creates() -> None:
    broker = NatsJetStreamBroker("nats://a:4222,nats://b:4222", replicas=3)
    connection = broker.connection
    assert connection.replicas == 3
    assert connection.new_stream_config()["num_replicas"] == 3
    assert connection.new_stream_config(dead_letter=True)["num_replicas"] == 3
    assert NatsConnection("nats://h").new_stream_config()["num_replicas"] == 1
    # stream_config still wins over the option.
    own = NatsConnection("nats://h", replicas=3, stream_config={"num_replicas": 5})
    assert own.new_stream_config()["num_replicas"] == 5


@pytest.mark.parametrize("bad", [0, 6, -1, 2.0, True, "3"])
def test_a_bad_replica_count_is_refused_naming_the_option(bad: Any) -> None:
    with pytest.raises(exceptions.ConfigurationError, match="replicas"):
        NatsJetStreamBroker("nats://h", replicas=bad)


@pytest.mark.parametrize(
    ("cluster", "replicas", "warned"),
    [("c1", 1, True), ("c1", 3, False), (None, 1, False)],
)
async def test_single_replica_on_a_cluster_is_a_warning(
    caplog: pytest.LogCaptureFixture, cluster: str | None, replicas: int, warned: bool
) -> None:
    caplog.set_level(logging.INFO, "fastapi_outbox.brokers.nats")
    js = FakeJetStream({})
    connection = NatsConnection(client=FakeClient(js, cluster), replicas=replicas)
    await connection.connect()
    assert connection.server_cluster == cluster
    await connection.ensure_stream("orders")
    await connection.ensure_stream("orders.dlq", dead_letter=True)
    assert [c["num_replicas"] for c in js.added] == [replicas, replicas]
    single = [r for r in caplog.records if getattr(r, "action", "") == "broker.single_replica"]
    assert len(single) == (2 if warned else 0)
    assert all(r.levelno == logging.WARNING for r in single)


async def test_an_existing_stream_with_fewer_replicas_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "fastapi_outbox.brokers.nats")
    js = FakeJetStream({"orders": 1, "invoices": 3})
    connection = NatsConnection(client=FakeClient(js, "c1"), replicas=3)
    await connection.connect()
    await connection.ensure_stream("orders")
    await connection.ensure_stream("invoices")
    short = [r for r in caplog.records if getattr(r, "action", "") == "broker.replicas_short"]
    assert [(r.stream, r.replicas, r.needed_replicas) for r in short] == [("orders", 1, 3)]  # type: ignore[attr-defined]
    assert js.added == []


def test_broker_from_url_passes_replicas_and_the_server_list() -> None:
    from fastapi_outbox.brokers import broker_from_url

    broker = broker_from_url("nats://a:4222,nats://b:4222", replicas=3)
    assert isinstance(broker, NatsJetStreamBroker)
    assert broker.connection.replicas == 3
    assert broker.connection.url == "nats://a:4222,nats://b:4222"
