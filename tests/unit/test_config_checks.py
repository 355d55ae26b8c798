"""The Outbox's configuration checks (``fastapi_outbox.config_checks``): each refusal names
the setting or the broker it is about, and nothing needs a database."""

from __future__ import annotations

import pytest

from fastapi_outbox import config_checks
from fastapi_outbox.exceptions import ConfigurationError
from fastapi_outbox.settings import OutboxSettings


def test_postgresql_sqlite_and_mysql_are_the_databases() -> None:
    config_checks.check_database("postgresql")
    config_checks.check_database("sqlite")
    config_checks.check_database("mysql")  # MariaDB too: SQLAlchemy calls both mysql
    with pytest.raises(ConfigurationError, match="unsupported database 'oracle'"):
        config_checks.check_database("oracle")


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "ü", 3])
def test_a_broker_name_is_a_short_token(name: object) -> None:
    with pytest.raises(ConfigurationError, match="invalid broker name") as info:
        config_checks.check_broker_names([name], [])
    assert repr(name) in str(info.value)
    with pytest.raises(ConfigurationError, match="invalid broker name"):
        config_checks.check_broker_names([], [name])


def test_a_broker_name_is_internal_or_external_not_both() -> None:
    config_checks.check_broker_names(["default", "audit.v1"], ["partner-1"])
    with pytest.raises(ConfigurationError, match="internal and external: a, b"):
        config_checks.check_broker_names({"b": 1, "a": 2, "c": 3}, ["a", "b"])


class _Broker:
    def __init__(self, window: object) -> None:
        self.dedup_window_seconds = window


def test_a_dedup_window_shorter_than_a_late_republish_is_refused() -> None:
    settings = OutboxSettings()
    needed = settings.dedup_window_needed_seconds
    config_checks.check_dedup_window("default", _Broker(needed), settings)
    config_checks.check_dedup_window("default", _Broker(None), settings)  # no window: none
    config_checks.check_dedup_window("default", object(), settings)
    with pytest.raises(ConfigurationError) as info:
        config_checks.check_dedup_window("orders", _Broker(needed - 1), settings)
    message = str(info.value)
    assert "broker 'orders'" in message
    assert "lease_seconds + retry_max_delay_seconds + dedup_outage_seconds" in message
    assert "dedup_window_seconds" in message


def test_partitioning_needs_postgresql() -> None:
    config_checks.check_partitioning(None, "sqlite")
    config_checks.check_partitioning("daily", "postgresql")
    with pytest.raises(ConfigurationError, match=r"OUTBOX_PARTITIONING\) needs PostgreSQL"):
        config_checks.check_partitioning("daily", "sqlite")


def test_wal_capture_needs_postgresql_through_asyncpg() -> None:
    config_checks.check_wal_capture("postgresql", "asyncpg")
    for dialect, driver in (("postgresql", "psycopg"), ("sqlite", "aiosqlite")):
        with pytest.raises(ConfigurationError, match=r"OUTBOX_CAPTURE\) needs PostgreSQL") as info:
            config_checks.check_wal_capture(dialect, driver)
        assert f"not {dialect}+{driver}" in str(info.value)
