"""A dead letter older than ``inbox_retention_seconds`` put back on the stream
is handled again by every other group whose inbox row of it is gone. The CLI warns and
needs ``--force``; the dashboard answers 409 with the warning and replays only with
``force``. On Redis, with the CLI run by ``run_cli``."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
from fastapi import FastAPI

from fastapi_outbox import Message, Outbox
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.ops.dashboard.router import CSRF_COOKIE, CSRF_HEADER
from tests.conftest import asgi_client, run_cli
from tests.integration.consume.test_consumer_contract import _redis
from tests.integration.ops.test_consumer_operations import _fetch

pytestmark = pytest.mark.usefixtures("quick_fetch")

APP = "tests.integration.consumer_cli_app:outbox"


def uuid7_at(seconds_ago: float) -> str:
    """A UUIDv7 made ``seconds_ago``: the id of a message created then."""
    ms = int((time.time() - seconds_ago) * 1000)
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) & 0xFFF) << 64 | (0b10 << 62)
    return str(uuid.UUID(int=value | (rand & ((1 << 62) - 1))))


async def test_old_dead_letters_need_force(redis_url: str, pg_url: str) -> None:
    async with _redis(redis_url, pg_url) as h:
        stream = h.stream()
        outbox = Outbox(
            pg_url, brokers={"default": broker_from_url(redis_url)}, dashboard_dependencies=[]
        )
        await outbox.create_tables()

        @outbox.subscriber(stream, group="billing", start="all")
        async def bill(message: Message) -> None:
            pass

        consumer = outbox.subscribers[0].make_consumer()
        await consumer.setup()
        old_id, new_id = uuid7_at(20 * 86400), uuid7_at(60)  # retention: 14 days
        await h.inject(stream, old_id, "OrderPlaced", {"n": 1}, {})
        await h.inject(stream, new_id, "OrderPlaced", {"n": 2}, {})
        for delivery in await _fetch(consumer, 2):
            await consumer.dead_letter(delivery, "RuntimeError: billing was broken")
        entries = {d.message_id: d.entry_id for d in await consumer.dead_letters()}
        env = {"CONSUMER_DATABASE_URL": pg_url, "CONSUMER_BROKER_URL": redis_url}
        env["CONSUMER_STREAM"] = stream
        replay = ("replay", "--app", APP, "--dead-letter", stream, "--group", "billing")

        app = FastAPI()
        app.include_router(outbox.dashboard_router)
        try:
            async with asgi_client(app) as client:
                page = await client.get("/outbox/dashboard")
                assert "Put the 2 dead letter(s) of group billing" in page.text
                headers = {CSRF_HEADER: client.cookies[CSRF_COOKIE]}
                body: dict[str, Any] = {"stream": stream, "group": "billing"}
                warned = await client.post(
                    "/outbox/dashboard/api/replay-dead-letters", json=body, headers=headers
                )
                assert warned.status_code == 409, warned.text
                assert "older than inbox_retention_seconds" in warned.json()["detail"]
                assert await consumer.count_dead_letters() == 2

                refused = run_cli(*replay, env=env)
                assert refused.returncode == 2, refused.stderr
                assert "1 dead letter(s) of group 'billing'" in refused.stderr
                assert "--force" in refused.stderr and old_id in refused.stderr
                dry = run_cli(*replay, "--dry-run", env=env)
                assert dry.returncode == 0, dry.stderr
                assert "2 dead letter(s) of billing would go back" in dry.stdout
                assert "1 older than inbox_retention_seconds" in dry.stdout
                assert await consumer.count_dead_letters() == 2

                recent = run_cli(*replay, "--entry", entries[new_id], env=env)
                assert recent.returncode == 0, recent.stderr
                assert "replayed 1 dead letter(s)" in recent.stdout
                forced = await client.post(
                    "/outbox/dashboard/api/replay-dead-letters",
                    json={**body, "force": True},
                    headers=headers,
                )
                assert forced.json() == {"changed": 1, "problems": []}
            assert await consumer.count_dead_letters() == 0
            again = await _fetch(consumer, 2)
            assert sorted(d.message_id for d in again) == sorted([old_id, new_id])
        finally:
            await consumer.aclose()
            await outbox.aclose()


async def test_force_on_the_command_line(redis_url: str, pg_url: str) -> None:
    async with _redis(redis_url, pg_url) as h:
        stream = h.stream()
        outbox = Outbox(pg_url, brokers={"default": broker_from_url(redis_url)})

        @outbox.subscriber(stream, group="billing", start="all")
        async def bill(message: Message) -> None:
            pass

        consumer = outbox.subscribers[0].make_consumer()
        await consumer.setup()
        await h.inject(stream, uuid7_at(30 * 86400), "OrderPlaced", {"n": 1}, {})
        [delivery] = await _fetch(consumer, 1)
        await consumer.dead_letter(delivery, "RuntimeError: billing was broken")
        env = {"CONSUMER_DATABASE_URL": pg_url, "CONSUMER_BROKER_URL": redis_url}
        env["CONSUMER_STREAM"] = stream
        try:
            forced = run_cli(
                "replay", "--app", APP, "--dead-letter", stream, "--group", "billing", "--force",
                env=env,
            )  # fmt: skip
            assert forced.returncode == 0, forced.stderr
            assert "replayed 1 dead letter(s)" in forced.stdout
            assert await consumer.count_dead_letters() == 0
        finally:
            await consumer.aclose()
            await outbox.aclose()
