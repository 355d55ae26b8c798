"""The read models of health, ``status`` and the dashboard, folded from statement rows
without a database: zero-filled entries, ages by the database's clock (None while not yet
due), the ordered-dispatch pending age and blocked keys, the published totals only when
asked, and a per-minute series with empty minutes as 0.
"""

from __future__ import annotations

import datetime as dt
import uuid

from fastapi_outbox.storage import read_models
from fastapi_outbox.storage.read_models import BrokerStats

NOW = dt.datetime(2026, 11, 25, 12, 0, 30, tzinfo=dt.UTC)


def rows(**named: list[tuple[object, ...]]) -> dict[str, list[tuple[object, ...]]]:
    base: dict[str, list[tuple[object, ...]]] = {
        "active": [],
        "abandoned": [],
        "scheduled": [],
        "recent": [],
        "waiting_ordered": [],
        "blocking_ordered": [],
        "published": [],
    }
    return {**base, **named}


def test_aware_reads_sqlite_text_and_naive_times_as_utc() -> None:
    assert read_models.aware("2026-11-25 12:00:00.000000") == dt.datetime(
        2026, 11, 25, 12, tzinfo=dt.UTC
    )
    assert read_models.aware(dt.datetime(2026, 1, 1)).tzinfo is dt.UTC
    assert read_models.age(NOW, NOW - dt.timedelta(seconds=5)) == 5.0
    assert read_models.age(NOW, NOW + dt.timedelta(seconds=5)) is None  # not due yet


def test_broker_stats_zero_fills_named_brokers_and_counts_per_status() -> None:
    out = read_models.broker_stats(
        ["redis", "nats"],
        NOW,
        rows(
            active=[
                ("redis", "pending", 7, NOW - dt.timedelta(seconds=10)),
                ("redis", "failed", 2, None),
                ("memory", "processing", 1, None),
            ],
            abandoned=[("redis", 3)],
            scheduled=[("redis", 4)],
            recent=[("nats", 9)],
        ),
    )
    assert list(out) == ["redis", "nats", "memory"]
    assert out["redis"] == BrokerStats(
        "redis",
        pending=7,
        failed=2,
        abandoned=3,
        scheduled=4,
        oldest_pending_age_seconds=10.0,
    )
    assert out["nats"] == BrokerStats("nats", published_last_minute=9)
    assert out["memory"].processing == 1 and out["memory"].published is None


def test_broker_stats_ordered_takes_the_age_of_the_takeable_rows_and_the_blocked_keys() -> None:
    blocker = uuid.uuid4()
    out = read_models.broker_stats(
        [],
        NOW,
        rows(
            active=[("redis", "pending", 5, NOW - dt.timedelta(seconds=100))],
            waiting_ordered=[("redis", NOW - dt.timedelta(seconds=2))],
            blocking_ordered=[("redis", 1, blocker.hex)],
        ),
        ordered=True,
    )
    assert out["redis"].oldest_pending_age_seconds == 2.0  # not the blocked row's 100 s
    assert out["redis"].blocked_keys == 1
    assert out["redis"].blocking_message == str(blocker)


def test_broker_stats_published_totals_zero_every_broker_then_count() -> None:
    out = read_models.broker_stats(
        ["a", "b"], NOW, rows(published=[("a", 12)]), published_totals=True
    )
    assert (out["a"].published, out["b"].published) == (12, 0)


def test_stream_stats_one_zero_filled_entry_per_broker_and_stream_sorted() -> None:
    out = read_models.stream_stats(
        NOW,
        {
            "active": [
                ("redis", "orders", "pending", 3, NOW - dt.timedelta(seconds=1)),
                ("memory", "z", "failed", 1, None),
            ],
            "abandoned": [("redis", "billing", 2)],
            "scheduled": [("redis", "orders", 1)],
        },
    )
    assert [(e["broker"], e["stream"]) for e in out] == [
        ("memory", "z"),
        ("redis", "billing"),
        ("redis", "orders"),
    ]
    assert out[2] == {
        "broker": "redis",
        "stream": "orders",
        "pending": 3,
        "processing": 0,
        "failed": 0,
        "abandoned": 0,
        "scheduled": 1,
        "oldest_pending_age_seconds": 1.0,
    }
    assert out[1]["abandoned"] == 2 and out[1]["oldest_pending_age_seconds"] is None


def test_per_minute_covers_every_minute_ending_with_the_database_clock() -> None:
    minute = NOW.replace(second=0)
    series = read_models.per_minute(
        NOW,
        [(minute - dt.timedelta(minutes=2), 5), ("2026-11-25 12:00:00.000000", 1)],
        3,
    )
    assert series == [
        (minute - dt.timedelta(minutes=2), 5),
        (minute - dt.timedelta(minutes=1), 0),
        (minute, 1),
    ]
