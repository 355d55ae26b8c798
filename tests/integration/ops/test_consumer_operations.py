"""Operating consumers: ``fastapi-outbox consumers`` (lag, pending, dead letters, inbox),
``replay --dead-letter`` and the consumers in ``/outbox/health``, on Redis, NATS, RabbitMQ and
Kafka."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.ops.health import compute_health
from tests.conftest import run_cli
from tests.integration.consume.test_consumer_contract import _kafka, _nats, _rabbitmq, _redis

APP = "tests.integration.consumer_cli_app:outbox"


@pytest.mark.parametrize("kind", ["redis", "nats", "rabbitmq", "kafka"])
async def test_consumers_command_health_and_dead_letter_replay(
    kind: str, pg_url: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue(f"{kind}_url"))
    if kind == "kafka":  # a group join waits half the session timeout on Tansu
        url += "?session_timeout_seconds=2&heartbeat_interval_seconds=0.5"
    harness_of = {"redis": _redis, "nats": _nats, "rabbitmq": _rabbitmq, "kafka": _kafka}[kind]
    async with harness_of(url, pg_url) as h:
        stream = h.stream()
        # RabbitMQ: the harness's exchange (the test's own).
        options = {"exchange": h.broker.exchange} if kind == "rabbitmq" else {}  # type: ignore[attr-defined]
        # The view of a process that runs no relays (never started, on purpose).
        outbox = Outbox(
            pg_url,
            brokers={"default": broker_from_url(url, **options)},
            settings=OutboxSettings(run_relays=False),
        )
        await outbox.create_tables()

        @outbox.subscriber(stream, group="billing", start="all")
        async def bill(message: Message) -> None:
            pass

        sub = outbox.subscribers[0]
        consumer = sub.make_consumer()
        await consumer.setup()
        for n in range(3):
            await h.inject(stream, f"m-{n}", "OrderPlaced", {"n": n}, {})
        deliveries = await _fetch(consumer, 3)
        await consumer.dead_letter(deliveries[0], "RuntimeError: billing is broken")
        await consumer.ack([deliveries[1]])  # one acked, one left pending

        env = {
            "CONSUMER_DATABASE_URL": pg_url,
            "CONSUMER_BROKER_URL": url,
            "CONSUMER_STREAM": stream,
            **({"CONSUMER_EXCHANGE": options["exchange"]} if options else {}),
        }
        listed = run_cli("consumers", "--app", APP, "--json", "--dead-letters", env=env)
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)
        assert (row["stream"], row["group"], row["broker"]) == (stream, "billing", "default")
        if kind == "kafka":
            # Kafka commits a position: the unsettled message and what follows it is lag
            # (here on the partition the harness writes to); pending is this process's.
            assert row["pending"] is None and row["lag"] == 1
            assert row["lag_partitions"] == {"0": 1, "1": 0, "2": 0}
        else:
            # AMQP does not count a queue's unacknowledged deliveries: RabbitMQ says None.
            assert row["pending"] == (None if kind == "rabbitmq" else 1) and row["lag"] == 0
        assert row["dead_letters"] == 1 and row["handled"] == 0
        [letter] = row["dead_letter_entries"]
        assert letter["message_id"] == "m-0" and "billing is broken" in letter["error"]
        table = run_cli("consumers", "--app", APP, env=env)
        assert table.returncode == 0 and "billing" in table.stdout, table.stderr
        if kind == "kafka":
            assert "lag_partitions" in table.stdout and "0:1 1:0 2:0" in table.stdout
        no_app = run_cli("consumers", "--url", pg_url)
        assert no_app.returncode == 2 and "--app" in no_app.stderr

        health = await compute_health(outbox)
        assert health.status == "degraded"
        assert any("1 dead letter(s) of consumer group 'billing'" in r for r in health.reasons)
        assert health.consumers[0].dead_letters == 1

        wrong = run_cli("replay", "--app", APP, "--dead-letter", stream, "--group", "nope", env=env)
        assert wrong.returncode == 2 and "no subscriber for stream" in wrong.stderr
        replayed = run_cli(
            "replay", "--app", APP, "--dead-letter", stream, "--group", "billing",
            "--entry", letter["entry_id"], env=env,
        )  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        assert "replayed 1 dead letter(s)" in replayed.stdout
        assert await consumer.count_dead_letters() == 0
        again = await _fetch(consumer, 1)
        assert [(d.message_id, d.json()) for d in again] == [("m-0", {"n": 0})]
        await consumer.aclose()
        await outbox.aclose()


async def _fetch(consumer: Any, n: int) -> list[Any]:
    got: list[Any] = []
    for _ in range(20):
        got += await consumer.fetch(n - len(got), 0.5)
        if len(got) >= n:
            break
    assert len(got) == n
    return got
