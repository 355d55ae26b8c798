"""Liveness says only whether this process can make progress: a worker that should run
here and stopped. Outages elsewhere and an outbox not started here are readiness matters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastapi_outbox.ops.health import liveness


def port(*, started: bool, relay_running: bool = True, subscriber_running: bool = True) -> Any:
    relay = SimpleNamespace(running=relay_running, broker_ok=False)  # broker down: irrelevant
    return SimpleNamespace(
        lifecycle=SimpleNamespace(started=started),
        all_brokers={"default": object()},
        relays=SimpleNamespace(tables={"default": relay} if started else {}, wal=None),
        wal_slot=None,
        subscribers=[SimpleNamespace(group="billing", stream="orders", running=subscriber_running)],
    )


def test_running_workers_are_alive_even_with_their_broker_down() -> None:
    assert liveness(port(started=True)) == []


def test_a_stopped_relay_or_subscriber_fails_liveness() -> None:
    assert liveness(port(started=True, relay_running=False)) == ["relay 'default' is not running"]
    assert liveness(port(started=True, subscriber_running=False)) == [
        "consumer group 'billing' on 'orders' is not running"
    ]


def test_a_process_that_runs_no_workers_is_alive() -> None:
    """An API-only process, or one that never entered the lifespan: restarting it cures
    nothing (readiness reports the latter, with the fix)."""
    assert liveness(port(started=False, relay_running=False, subscriber_running=False)) == []
