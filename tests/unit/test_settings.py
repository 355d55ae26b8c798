"""``OutboxSettings``: contract field names, defaults, and errors that name the setting.

Two paths, two error types, each failing at startup with a message naming the setting:

* ``OutboxSettings(batch_size=0)`` (the caller passes values) raises pydantic's
  ``ValidationError`` (a ``ValueError``) whose text names the field;
* ``OutboxSettings.from_env()``, which ``Outbox(settings=None)`` uses, raises
  ``ConfigurationError`` naming the environment variable ``OUTBOX_<FIELD>``.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fastapi_outbox import ConfigurationError, Outbox, OutboxSettings, build_table
from fastapi_outbox.settings import RENAMED_VARIABLES

CONTRACT_DEFAULTS = {
    "table_name": "outbox_messages",
    "batch_size": 500,  # the largest claim; claims adapt from min_batch_size (25)
    "min_batch_size": 25,
    "workers": 2,
    "lease_seconds": 30,
    "poll_interval_seconds": 1.0,
    "max_attempts": 10,
    "retry_base_delay_seconds": 1,
    "retry_multiplier": 2,
    "retry_max_delay_seconds": 300,
    "retry_jitter": 0.25,
    "ordered": False,
    "published_retention_seconds": 7 * 24 * 3600,
    "abandoned_retention_seconds": 30 * 24 * 3600,
    "cleanup_interval_seconds": 3600,
    "health_max_pending_age_seconds": 60,
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OUTBOX_<field> variable of the outer environment leaks into these tests."""
    import os

    for name in list(os.environ):
        known = name.startswith("OUTBOX_") and name[7:].lower() in OutboxSettings.model_fields
        if known or name.upper() in RENAMED_VARIABLES:
            monkeypatch.delenv(name)


def test_contract_field_names_and_defaults() -> None:
    settings = OutboxSettings()
    for name, default in CONTRACT_DEFAULTS.items():
        assert getattr(settings, name) == default, name


def test_none_retention_keeps_forever() -> None:
    settings = OutboxSettings(published_retention_seconds=None, abandoned_retention_seconds=None)
    assert settings.published_retention_seconds is None
    assert settings.abandoned_retention_seconds is None


def test_env_variables_use_the_outbox_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "3")
    monkeypatch.setenv("OUTBOX_PUBLISH_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "7")
    monkeypatch.setenv("OUTBOX_ORDERED", "true")
    monkeypatch.setenv("OUTBOX_PUBLISHED_RETENTION_SECONDS", "60")
    settings = OutboxSettings.from_env()
    assert settings.lease_seconds == 3.0
    assert settings.batch_size == 7
    assert settings.ordered is True
    assert settings.published_retention_seconds == 60.0
    # keyword overrides beat the environment
    assert OutboxSettings.from_env(batch_size=9).batch_size == 9


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batch_size", 0),
        ("workers", 0),
        ("lease_seconds", -1),
        ("poll_interval_seconds", 0),
        ("max_attempts", 0),
        ("retry_jitter", 2),
        ("retry_multiplier", 0.5),
        ("max_payload_bytes", 0),
    ],
)
def test_invalid_value_in_constructor_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        OutboxSettings(**{field: value})  # type: ignore[arg-type]
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_max_poll_below_poll_names_both_settings() -> None:
    with pytest.raises(ValidationError) as info:
        OutboxSettings(poll_interval_seconds=5, max_poll_interval_seconds=1)
    text = str(info.value)
    assert "max_poll_interval_seconds" in text and "poll_interval_seconds" in text


def test_relays_are_switched_off_by_their_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_RUN_RELAYS", "false")
    assert OutboxSettings.from_env().run_relays is False


def test_the_old_relays_variable_is_refused_naming_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ignored silently, it would start relays in an API-only process that meant to run none.
    monkeypatch.setenv("OUTBOX_RUN_DISPATCHERS", "false")
    with pytest.raises(ConfigurationError) as info:
        OutboxSettings.from_env()
    text = str(info.value)
    assert "OUTBOX_RUN_DISPATCHERS" in text and "OUTBOX_RUN_RELAYS" in text


def test_max_poll_below_poll_from_env_names_both_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_POLL_INTERVAL_SECONDS", "5")
    monkeypatch.setenv("OUTBOX_MAX_POLL_INTERVAL_SECONDS", "1")
    with pytest.raises(ConfigurationError) as info:
        OutboxSettings.from_env()
    text = str(info.value)
    assert "OUTBOX_MAX_POLL_INTERVAL_SECONDS" in text and "OUTBOX_POLL_INTERVAL_SECONDS" in text
    # a cross-field error points at no invented variable
    assert "OUTBOX_SETTINGS" not in text


def test_retry_max_below_base_is_refused() -> None:
    with pytest.raises(ValidationError, match="retry_max_delay_seconds"):
        OutboxSettings(retry_base_delay_seconds=10, retry_max_delay_seconds=1)


def test_invalid_env_value_raises_configuration_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "-1")
    with pytest.raises(ConfigurationError) as info:
        OutboxSettings.from_env()
    assert "OUTBOX_LEASE_SECONDS" in str(info.value)
    assert "lease_seconds" in str(info.value)


def test_non_numeric_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "lots")
    with pytest.raises(ConfigurationError, match="OUTBOX_BATCH_SIZE"):
        OutboxSettings.from_env()


def test_outbox_without_settings_reads_env_and_fails_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "-1")
    with pytest.raises(ConfigurationError, match="OUTBOX_LEASE_SECONDS"):
        Outbox("sqlite+aiosqlite://", settings=None)


def test_outbox_without_settings_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "3")
    monkeypatch.setenv("OUTBOX_PUBLISH_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("OUTBOX_TABLE_NAME", "events_out")
    outbox = Outbox("sqlite+aiosqlite://")
    assert outbox.settings.lease_seconds == 3.0
    assert outbox.table.name == "events_out"


@pytest.mark.parametrize(
    "name", ["orders; drop table x", "1orders", "orders-out", "a" * 64, "", 'x"y', "ordérs"]
)
def test_table_name_must_be_a_plain_identifier(name: str) -> None:
    with pytest.raises(ValidationError, match="table_name"):
        OutboxSettings(table_name=name)
    with pytest.raises(ConfigurationError, match="table_name"):
        build_table(name)


def test_table_name_from_env_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_TABLE_NAME", "orders; drop table x")
    with pytest.raises(ConfigurationError, match="OUTBOX_TABLE_NAME"):
        OutboxSettings.from_env()


def test_settings_are_frozen_and_reject_unknown_fields() -> None:
    settings = OutboxSettings()
    with pytest.raises(ValidationError):
        settings.batch_size = 5
    with pytest.raises(ValidationError, match="batch_sise"):
        OutboxSettings(batch_sise=5)  # type: ignore[call-arg]


def test_dedup_window_outlasts_lease_and_longest_backoff() -> None:
    settings = OutboxSettings(lease_seconds=30, retry_max_delay_seconds=300)
    assert settings.dedup_window_seconds > 330


def test_dedup_window_covers_an_outage_of_hours_by_default() -> None:
    settings = OutboxSettings(lease_seconds=30, retry_max_delay_seconds=300)
    assert settings.dedup_outage_seconds == 4 * 3600
    assert settings.dedup_window_seconds >= 330 + 4 * 3600
    shorter = OutboxSettings(dedup_outage_seconds=600)
    assert shorter.dedup_window_seconds == shorter.lease_seconds + 300 + 600 + 60


def test_a_broker_window_shorter_than_the_outage_bound_is_refused() -> None:
    from fastapi_outbox.brokers import RedisStreamsBroker

    broker = RedisStreamsBroker("redis://127.0.0.1:1", dedup_window_seconds=3600)
    with pytest.raises(ConfigurationError, match="dedup_outage_seconds"):
        Outbox("sqlite+aiosqlite://", brokers={"default": broker})


def test_lease_must_outlive_the_publish_timeout_with_a_margin() -> None:
    with pytest.raises(ConfigurationError) as info:
        OutboxSettings.from_env(lease_seconds=10, publish_timeout_seconds=8)
    message = str(info.value)
    assert "lease_seconds" in message and "publish_timeout_seconds" in message
    assert OutboxSettings(lease_seconds=12, publish_timeout_seconds=8).lease_seconds == 12


def test_lease_rule_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "2")
    with pytest.raises(ConfigurationError, match="OUTBOX_PUBLISH_TIMEOUT_SECONDS"):
        OutboxSettings.from_env()


@pytest.mark.parametrize("kind", ["redis", "nats"])
def test_broker_dedup_window_shorter_than_lease_plus_backoff_is_refused(kind: str) -> None:
    from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker

    broker: Any = (
        RedisStreamsBroker("redis://127.0.0.1:1", dedup_window_seconds=100)
        if kind == "redis"
        else NatsJetStreamBroker("nats://127.0.0.1:1", stream_config={"duplicate_window": 100})
    )
    settings = OutboxSettings(lease_seconds=30, retry_max_delay_seconds=300, dedup_outage_seconds=0)
    with pytest.raises(ConfigurationError) as info:
        Outbox("sqlite+aiosqlite://", brokers={"default": broker}, settings=settings)
    message = str(info.value)
    assert "'default'" in message and "dedup_window_seconds" in message
    assert "lease_seconds + retry_max_delay_seconds + dedup_outage_seconds (330 s)" in message
    # A window that covers lease + longest backoff is accepted.
    broker = RedisStreamsBroker("redis://127.0.0.1:1", dedup_window_seconds=330)
    Outbox("sqlite+aiosqlite://", brokers={"default": broker}, settings=settings)


def test_nats_stream_limits_are_validated() -> None:
    from fastapi_outbox.brokers import NatsJetStreamBroker

    with pytest.raises(ConfigurationError, match="stream_max_bytes"):
        NatsJetStreamBroker(stream_max_bytes=0)


def test_abandoned_retention_below_a_day_needs_the_opt_in() -> None:
    """Abandoned rows were never delivered: ``abandoned_retention_seconds=0`` would delete
    each one as it is abandoned, before anyone could replay it."""
    for seconds in (0, 3600, 86399):
        with pytest.raises(ConfigurationError) as info:
            OutboxSettings.from_env(abandoned_retention_seconds=seconds)
        assert "abandoned_retention_seconds" in str(info.value)
        assert "allow_short_abandoned_retention" in str(info.value)
    settings = OutboxSettings(abandoned_retention_seconds=0, allow_short_abandoned_retention=True)
    assert settings.abandoned_retention_seconds == 0
    assert OutboxSettings(abandoned_retention_seconds=86400).abandoned_retention_seconds == 86400


# -- groups: a reader finds a setting by the capability it tunes -------------------------------

#: A field of each group and a valid value for it, read from its flat variable.
GROUP_SAMPLES = {
    "database": ("table_name", "orders_outbox"),
    "wakeups": ("notify", "false"),
    "relay": ("workers", "3"),
    "retries": ("max_attempts", "4"),
    "consumers": ("consumer_batch_size", "50"),
    "retention": ("cleanup_batch_size", "100"),
    "payloads": ("max_payload_bytes", "2048"),
    "health": ("health_cache_seconds", "2"),
    "wal": ("wal_batch_size", "500"),
}


def test_every_setting_is_in_one_group_and_the_groups_follow_one_another() -> None:
    from fastapi_outbox.settings import SETTING_GROUPS, setting_group

    groups = [setting_group(name) for name in OutboxSettings.model_fields]
    assert set(groups) == set(SETTING_GROUPS)
    # Each group's fields are declared together, groups in the order the reference shows.
    assert list(dict.fromkeys(groups)) == list(SETTING_GROUPS)


def test_a_group_is_a_heading_only_the_variables_stay_flat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fastapi_outbox.settings import SETTING_GROUPS, setting_group

    assert set(GROUP_SAMPLES) == set(SETTING_GROUPS)
    assert OutboxSettings.model_config.get("env_nested_delimiter") is None
    for name, field in OutboxSettings.model_fields.items():
        assert field.alias is None and field.validation_alias is None, name
    for group, (name, text) in GROUP_SAMPLES.items():
        assert setting_group(name) == group
        monkeypatch.setenv(f"OUTBOX_{name.upper()}", text)
    settings = OutboxSettings.from_env()
    assert settings.table_name == "orders_outbox" and settings.notify is False
    assert settings.workers == 3 and settings.max_attempts == 4
    assert settings.consumer_batch_size == 50 and settings.cleanup_batch_size == 100
    assert settings.max_payload_bytes == 2048 and settings.health_cache_seconds == 2
    assert settings.wal_batch_size == 500


def test_the_reference_page_lists_each_setting_under_its_group() -> None:
    import re
    from pathlib import Path

    from fastapi_outbox.settings import SETTING_GROUPS, setting_group

    page = Path(__file__).parents[2] / "docs" / "reference" / "settings.md"
    hand_written = page.read_text().split("<!-- generated")[0]
    sections = dict(re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", hand_written, re.M | re.S))
    titles = [title for title, _ in SETTING_GROUPS.values()]
    assert [t for t in sections if t in titles] == titles
    for name in OutboxSettings.model_fields:
        title = SETTING_GROUPS[setting_group(name)][0]
        rows = [r for r in sections[title].splitlines() if r.startswith("| `")]
        assert any(f"`{name}`" in row.split(" | ")[0] for row in rows), (name, title)
