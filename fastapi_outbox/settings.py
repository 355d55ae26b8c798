"""``OutboxSettings``: every tunable of the outbox, read from ``OUTBOX_*`` environment variables.

Field names are part of the public contract (``OUTBOX_LEASE_SECONDS=3`` works). Invalid
values fail when the settings are built, with a message naming the setting.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import os
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from fastapi_outbox import exceptions

TABLE_NAME = "outbox_messages"
#: Largest claim of one worker (``batch_size``): claims grow to it while the backlog lasts.
BATCH_SIZE = 500
#: Claim size of an idle relay (``min_batch_size``).
MIN_BATCH_SIZE = 25
WORKERS = 2
LEASE_SECONDS = 30.0
POLL_INTERVAL_SECONDS = 1.0
MAX_POLL_INTERVAL_SECONDS = 30.0
MAX_ATTEMPTS = 10
RETRY_BASE_DELAY_SECONDS = 1.0
RETRY_MULTIPLIER = 2.0
RETRY_MAX_DELAY_SECONDS = 300.0
RETRY_JITTER = 0.25
BROKER_BACKOFF_MAX_SECONDS = 30.0
PUBLISHED_RETENTION_SECONDS = 7 * 24 * 3600.0
ABANDONED_RETENTION_SECONDS = 30 * 24 * 3600.0
CLEANUP_INTERVAL_SECONDS = 3600.0
CLEANUP_BATCH_SIZE = 5000
HEALTH_MAX_PENDING_AGE_SECONDS = 60.0
HEALTH_CACHE_SECONDS = 1.0
MAX_PAYLOAD_BYTES = 1024 * 1024
SHUTDOWN_TIMEOUT_SECONDS = 10.0
NOTIFY_INTERVAL_SECONDS = 0.002
PUBLISH_TIMEOUT_SECONDS = 10.0
#: Furthest ahead a delayed message may be due (30 days).
MAX_DELAY_SECONDS = 30 * 86400.0
#: Bound of each relay statement (server side: statement_timeout, and client side).
DB_STATEMENT_TIMEOUT_SECONDS = 10.0
#: Bound of a relay's wait for a lock (the ordered claimers' turn, a row lock).
DB_LOCK_TIMEOUT_SECONDS = 5.0
#: Extra margin added to lease + maximal backoff for the brokers' de-duplication window.
DEDUP_MARGIN_SECONDS = 60.0
#: The longest database or broker outage whose republishes the brokers still de-duplicate
#: (4 hours): a message published just before the outage and marked only after it (the
#: mark failed, or the broker's ack was lost) is published again when the outage ends.
DEDUP_OUTAGE_SECONDS = 4 * 3600.0
#: ``lease_seconds`` must be at least this many times ``publish_timeout_seconds``: a claim
#: must outlive its slowest publish plus the mark that follows, or another relay
#: takes the rows while they are being published (a duplicate for the de-duplication to
#: absorb at best).
LEASE_PUBLISH_MARGIN = 1.5
#: Consumers (``@outbox.subscriber``): see `fastapi_outbox.consume.subscriber`.
INBOX_TABLE_NAME = "outbox_inbox"
INBOX_RETENTION_SECONDS = 14 * 24 * 3600.0
CONSUMER_BATCH_SIZE = 100
CONSUMER_CONCURRENCY = 8
CONSUMER_MAX_ATTEMPTS = 5
CONSUMER_RETRY_BASE_DELAY_SECONDS = 0.5
CONSUMER_RETRY_MAX_DELAY_SECONDS = 30.0
CONSUMER_CLAIM_IDLE_SECONDS = 60.0
CONSUMER_UNKNOWN_TYPE_GRACE_SECONDS = 900.0
#: Partitions the keys of an ordered subscriber are hashed into (Redis, NATS): the most
#: processes that share its work.
CONSUMER_ORDERED_PARTITIONS = 16
#: ``abandoned_retention_seconds`` below this deletes undelivered messages before an
#: operator can look at them: it needs ``allow_short_abandoned_retention=True``.
MIN_ABANDONED_RETENTION_SECONDS = 86400.0

#: Rows of pgoutput (a transaction is a begin, its messages, a commit) one read of the
#: logical replication slot asks for in ``capture="wal"`` (``wal_batch_size``).
WAL_BATCH_SIZE = 10_000
#: How often a standby WAL relay tries to take over the slot (``wal_standby_poll_seconds``).
WAL_STANDBY_POLL_SECONDS = 1.0
#: Bound of one read of the slot (``wal_read_timeout_seconds``).
WAL_READ_TIMEOUT_SECONDS = 60.0
#: Bound of one confirm, pg_replication_slot_advance (``wal_confirm_timeout_seconds``).
WAL_CONFIRM_TIMEOUT_SECONDS = 30.0
#: WAL past the slot's confirmed position a read decodes at first (``wal_read_window_bytes``).
WAL_READ_WINDOW_BYTES = 64 * 1024 * 1024
#: Smallest read window (a WAL segment is 16 MiB by default).
WAL_MIN_READ_WINDOW_BYTES = 1024 * 1024

#: How often the LISTEN connection proves it is alive with a NOTIFY to itself
#: (``listen_check_interval_seconds``), and how long that round trip may take
#: (``listen_check_timeout_seconds``) before the connection is declared lost.
LISTEN_CHECK_INTERVAL_SECONDS = 10.0
LISTEN_CHECK_TIMEOUT_SECONDS = 5.0

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
#: An encryption key id travels in a header: letters, digits and ``._-``.
ENCRYPTION_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: AES key sizes (bytes) AES-GCM takes.
ENCRYPTION_KEY_SIZES = (16, 24, 32)

#: ``encryption_keys``: key id -> key, or a callable returning them (a KMS).
EncryptionKeys = dict[str, bytes] | Callable[[], Mapping[str, bytes]]


#: The capabilities the settings are grouped by, in the order the reference page shows them:
#: key -> (title, what its settings decide). Each field names its group with
#: ``json_schema_extra={"group": key}``; the environment variable stays ``OUTBOX_<FIELD>``.
SETTING_GROUPS: dict[str, tuple[str, str]] = {
    "database": (
        "Database",
        "The database, the outbox table's name and layout, and the bounds of the relays' "
        "statements.",
    ),
    "wakeups": (
        "Wake-ups (LISTEN/NOTIFY)",
        "How a commit wakes the relays up, and how a silently lost LISTEN connection is noticed.",
    ),
    "relay": ("Relay", "The relays that move committed messages to the brokers."),
    "retries": (
        "Retries and de-duplication",
        "What happens to a message a broker refuses, and how long a republished message is "
        "still recognised as a duplicate.",
    ),
    "consumers": ("Consumers", "The subscribers (``@outbox.subscriber``) and their inbox."),
    "retention": (
        "Retention and archive",
        "How long published, abandoned and inbox rows are kept, and the archive they may move to.",
    ),
    "payloads": (
        "Payloads",
        "What ``publish()`` accepts, and the stages a payload goes through: claim-check and "
        "encryption.",
    ),
    "health": ("Health and dashboard", "What /outbox/health answers and the dashboard shows."),
    "wal": (
        "WAL capture",
        "``capture='wal'``: messages written to PostgreSQL's WAL and relayed from a logical "
        "replication slot.",
    ),
}


def _group(key: str) -> dict[str, Any]:
    """The marker of a field of group ``key`` (one of `SETTING_GROUPS`)."""
    if key not in SETTING_GROUPS:
        raise KeyError(f"settings group {key!r} is not in SETTING_GROUPS")
    return {"group": key}


def setting_group(field: str) -> str:
    """The `SETTING_GROUPS` key of ``OutboxSettings`` field ``field``."""
    extra = OutboxSettings.model_fields[field].json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get("group"), str):
        raise KeyError(f"OutboxSettings.{field} names no group")
    return str(extra["group"])


#: Environment variables whose setting was renamed: old name → new name. Unknown
#: ``OUTBOX_*`` variables are otherwise ignored, so a deployment still setting the old one
#: would silently get the default.
RENAMED_VARIABLES: Mapping[str, str] = {"OUTBOX_RUN_DISPATCHERS": "OUTBOX_RUN_RELAYS"}


def _no_renamed_variables() -> None:
    """Refuse a variable whose setting was renamed, naming the one to set instead."""
    present = {name.upper() for name in os.environ}
    for old, new in RENAMED_VARIABLES.items():
        if old in present:
            field = new.removeprefix("OUTBOX_").lower()
            raise ValueError(
                f"{old} is set, but that setting is now called {field}: "
                f"set {new} instead and remove {old}"
            )


class OutboxSettings(BaseSettings):
    """Settings of an [`Outbox`][fastapi_outbox.Outbox]; environment variables
    ``OUTBOX_<FIELD>``."""

    # hide_input_in_errors: a rejected value may be a key or a URL with a password, and
    # validation errors end up in logs.
    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    # -- database ------------------------------------------------------------------------------
    database_url: str | None = Field(
        default=None,
        repr=False,
        description="Database URL used by the CLI when no --url/--app is given.",
        json_schema_extra=_group("database"),
    )
    table_name: str = Field(
        default=TABLE_NAME,
        description="Name of the outbox table.",
        json_schema_extra=_group("database"),
    )
    partitioning: str | None = Field(
        default=None,
        description="PostgreSQL: range-partition the outbox table by time (its UUIDv7 id's "
        "range), one partition per interval ('daily', 'hourly', '6h', '2d'); lookups by id "
        "read one partition, retention drops "
        "whole partitions (see fastapi_outbox.storage.partitions). None: one plain table.",
        json_schema_extra=_group("database"),
    )
    db_statement_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Bound of each relay database statement (PostgreSQL "
        "statement_timeout / idle_in_transaction_session_timeout, and the driver's command "
        "timeout): a frozen database or relay cannot hold a claim or the ordered lock. "
        "None: 10 s, or a third of lease_seconds when that is shorter.",
        json_schema_extra=_group("database"),
    )
    db_lock_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Bound of a relay's wait for a lock (PostgreSQL lock_timeout). "
        "None: half the statement timeout.",
        json_schema_extra=_group("database"),
    )

    # -- wakeups -------------------------------------------------------------------------------
    notify: bool = Field(
        default=True,
        description="Use PostgreSQL LISTEN/NOTIFY wake-ups.",
        json_schema_extra=_group("wakeups"),
    )
    notify_interval_seconds: float = Field(
        default=NOTIFY_INTERVAL_SECONDS,
        ge=0,
        le=1,
        description="Least time between two NOTIFYs of one process: commits in between "
        "share one (bounds the write path's cost; adds at most this to cross-process latency).",
        json_schema_extra=_group("wakeups"),
    )
    listen_check_interval_seconds: float = Field(
        default=LISTEN_CHECK_INTERVAL_SECONDS,
        gt=0,
        description="How often the LISTEN connection sends a NOTIFY to itself to prove it "
        "is alive (a NAT or firewall may drop it silently; TCP keepalives are set too).",
        json_schema_extra=_group("wakeups"),
    )
    listen_check_timeout_seconds: float = Field(
        default=LISTEN_CHECK_TIMEOUT_SECONDS,
        gt=0,
        description="A LISTEN self-check not answered within this is a lost connection: "
        "the relays poll every poll_interval_seconds at once and it reconnects.",
        json_schema_extra=_group("wakeups"),
    )

    # -- relay ---------------------------------------------------------------------------------
    broker_url: str | None = Field(
        default=None,
        repr=False,
        description="URL of the default broker (redis://, redis+cluster://, nats://, amqp://, "
        "kafka://, memory://) when an Outbox is given no brokers= (and for "
        "`fastapi-outbox dispatch` without --broker-url).",
        json_schema_extra=_group("relay"),
    )
    run_relays: bool = Field(
        default=True,
        description="Start the relays in the app lifespan (False: API only).",
        json_schema_extra=_group("relay"),
    )
    workers: int = Field(
        default=WORKERS,
        ge=1,
        le=64,
        description="Workers per relay (one relay per broker).",
        json_schema_extra=_group("relay"),
    )
    batch_size: int = Field(
        default=BATCH_SIZE,
        ge=1,
        le=10_000,
        description="Largest claim of one worker. Claims start at min_batch_size, double "
        "while they come back full and halve when they come back under a quarter full.",
        json_schema_extra=_group("relay"),
    )
    min_batch_size: int = Field(
        default=MIN_BATCH_SIZE,
        ge=1,
        le=10_000,
        description="Claim size of an idle relay (capped by batch_size; equal to it: "
        "every claim asks for batch_size rows).",
        json_schema_extra=_group("relay"),
    )
    lease_seconds: float = Field(default=LEASE_SECONDS, gt=0, json_schema_extra=_group("relay"))
    tenant_refresh_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Multi-tenant outboxes (Outbox(tenants=callable)): how often the "
        "callable is read again, so tenants are added and removed without a restart.",
        json_schema_extra=_group("relay"),
    )
    tenant_connection_budget: int = Field(
        default=10,
        ge=1,
        le=1000,
        description="Multi-tenant outboxes: the most database connections the relay holds "
        "across all tenants (half for its turns at once, half for the pools of the most "
        "recently active tenants; the others' idle connections are closed after a turn).",
        json_schema_extra=_group("relay"),
    )
    poll_interval_seconds: float = Field(
        default=POLL_INTERVAL_SECONDS, gt=0, json_schema_extra=_group("relay")
    )
    max_poll_interval_seconds: float = Field(
        default=MAX_POLL_INTERVAL_SECONDS, gt=0, json_schema_extra=_group("relay")
    )
    publish_timeout_seconds: float = Field(
        default=PUBLISH_TIMEOUT_SECONDS, gt=0, json_schema_extra=_group("relay")
    )
    broker_backoff_max_seconds: float = Field(
        default=BROKER_BACKOFF_MAX_SECONDS, gt=0, json_schema_extra=_group("relay")
    )
    ordered: bool = Field(default=False, json_schema_extra=_group("relay"))
    delete_on_publish: bool = Field(
        default=False,
        description="Delete rows once published instead of marking them.",
        json_schema_extra=_group("relay"),
    )
    shutdown_timeout_seconds: float = Field(
        default=SHUTDOWN_TIMEOUT_SECONDS, gt=0, json_schema_extra=_group("relay")
    )

    # -- retries -------------------------------------------------------------------------------
    max_attempts: int = Field(default=MAX_ATTEMPTS, ge=1, json_schema_extra=_group("retries"))
    retry_base_delay_seconds: float = Field(
        default=RETRY_BASE_DELAY_SECONDS, ge=0, json_schema_extra=_group("retries")
    )
    retry_multiplier: float = Field(
        default=RETRY_MULTIPLIER, ge=1, json_schema_extra=_group("retries")
    )
    retry_max_delay_seconds: float = Field(
        default=RETRY_MAX_DELAY_SECONDS, ge=0, json_schema_extra=_group("retries")
    )
    retry_jitter: float = Field(
        default=RETRY_JITTER, ge=0, le=1, json_schema_extra=_group("retries")
    )
    retry_deadline_seconds: float | None = Field(
        default=None,
        gt=0,
        description="A message still unpublished this long after its commit is abandoned, "
        "even with attempts left (None: only max_attempts ends retries).",
        json_schema_extra=_group("retries"),
    )
    dedup_outage_seconds: float = Field(
        default=DEDUP_OUTAGE_SECONDS,
        ge=0,
        description="The longest database or broker outage after which a message that was "
        "published but not marked (the mark failed, or the broker's ack was lost) is still "
        "de-duplicated when it is published again: part of the brokers' de-duplication "
        "window (Redis keys, JetStream duplicate_window), whose memory grows with it.",
        json_schema_extra=_group("retries"),
    )

    # -- consumers -----------------------------------------------------------------------------
    inbox_table_name: str = Field(
        default=INBOX_TABLE_NAME,
        description="Name of the consumers' inbox table.",
        json_schema_extra=_group("consumers"),
    )
    consumer_batch_size: int = Field(
        default=CONSUMER_BATCH_SIZE,
        ge=1,
        le=10_000,
        description="Messages read per fetch.",
        json_schema_extra=_group("consumers"),
    )
    consumer_concurrency: int = Field(
        default=CONSUMER_CONCURRENCY,
        ge=1,
        le=1024,
        description="Transactions a subscriber runs at once: batches of up to "
        "consumer_batch_size messages (one message each with batch=False or ordered=True). "
        "More in flight costs the garbage collector more than it gains on a small "
        "database; raise it for handlers that wait on slow I/O.",
        json_schema_extra=_group("consumers"),
    )
    consumer_max_attempts: int = Field(
        default=CONSUMER_MAX_ATTEMPTS,
        ge=1,
        description="Deliveries of a message before it is dead-lettered.",
        json_schema_extra=_group("consumers"),
    )
    consumer_retry_base_delay_seconds: float = Field(
        default=CONSUMER_RETRY_BASE_DELAY_SECONDS, ge=0, json_schema_extra=_group("consumers")
    )
    consumer_retry_max_delay_seconds: float = Field(
        default=CONSUMER_RETRY_MAX_DELAY_SECONDS, ge=0, json_schema_extra=_group("consumers")
    )
    consumer_claim_idle_seconds: float = Field(
        default=CONSUMER_CLAIM_IDLE_SECONDS,
        gt=0,
        description="A delivered message not acknowledged for this long goes to another "
        "consumer: Redis XAUTOCLAIM min-idle-time, NATS ack_wait; and the lease of an "
        "ordered subscriber's partition (a dead process's partitions move after it).",
        json_schema_extra=_group("consumers"),
    )
    consumer_unknown_type_grace_seconds: float = Field(
        default=CONSUMER_UNKNOWN_TYPE_GRACE_SECONDS,
        ge=0,
        description="A message of a type no Event class of the process declares, and no "
        "live process of its group handles, is handed back to the group for this long "
        "(counted from the first time a process of the group found it so) before it is "
        "dead-lettered: longer than a rolling deploy, so the version that handles it can "
        "start.",
        json_schema_extra=_group("consumers"),
    )
    consumer_ordered_partitions: int = Field(
        default=CONSUMER_ORDERED_PARTITIONS,
        ge=1,
        le=4096,
        description="Partitions an ordered subscriber (ordered=True, Redis and NATS) hashes "
        "keys into, each handled by one process at a time: the most processes that share "
        "its work. Every process of a group must use the same count (checked at start).",
        json_schema_extra=_group("consumers"),
    )

    # -- retention -----------------------------------------------------------------------------
    published_retention_seconds: float | None = Field(
        default=PUBLISHED_RETENTION_SECONDS, ge=0, json_schema_extra=_group("retention")
    )
    abandoned_retention_seconds: float | None = Field(
        default=ABANDONED_RETENTION_SECONDS, ge=0, json_schema_extra=_group("retention")
    )
    allow_short_abandoned_retention: bool = Field(
        default=False,
        description="Accept abandoned_retention_seconds below a day: abandoned messages "
        "(never delivered) are then deleted before most operators would see them.",
        json_schema_extra=_group("retention"),
    )
    inbox_retention_seconds: float | None = Field(
        default=INBOX_RETENTION_SECONDS,
        gt=0,
        description="Inbox rows older than this are deleted by the cleanup (None: kept "
        "forever). Must exceed the longest redelivery or replay window: a message "
        "redelivered after its inbox row is gone is handled again.",
        json_schema_extra=_group("retention"),
    )
    cleanup_interval_seconds: float = Field(
        default=CLEANUP_INTERVAL_SECONDS, gt=0, json_schema_extra=_group("retention")
    )
    cleanup_batch_size: int = Field(
        default=CLEANUP_BATCH_SIZE, ge=1, le=100_000, json_schema_extra=_group("retention")
    )
    archive: bool = Field(
        default=False,
        description="Retention moves published and abandoned rows past their retention to "
        "the archive table (archive_table_name) instead of deleting them; a partitioned "
        "table's finished partitions are re-attached to the archive, no row copied. "
        "`fastapi-outbox archive list/show` and the dashboard find archived messages.",
        json_schema_extra=_group("retention"),
    )
    archive_table_name: str | None = Field(
        default=None,
        description="Name of the archive table (archive=True); None: '<table_name>_archive'.",
        json_schema_extra=_group("retention"),
    )
    archive_retention_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Archived rows are deleted this long after they were archived (a "
        "partitioned archive drops whole partitions); None: kept forever.",
        json_schema_extra=_group("retention"),
    )

    # -- payloads ------------------------------------------------------------------------------
    max_payload_bytes: int = Field(
        default=MAX_PAYLOAD_BYTES, ge=1, json_schema_extra=_group("payloads")
    )
    max_delay_seconds: float = Field(
        default=MAX_DELAY_SECONDS,
        gt=0,
        description="Furthest ahead a delayed message (publish(delay=…/deliver_at=…)) may be due.",
        json_schema_extra=_group("payloads"),
    )
    claim_check_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Payloads larger than this (bytes of JSON text) are stored out of band "
        "in claim_check_store and the message carries a reference header instead; "
        "subscribers resolve it, handlers see the whole event. None (the default): off. "
        "max_payload_bytes still bounds every payload publish() accepts, so raise it too.",
        json_schema_extra=_group("payloads"),
    )
    claim_check_store: str = Field(
        default="database",
        description="Where claim-checked payloads go: 'database' (a table next to the "
        "outbox's, written in the producer's transaction; consumers must reach that "
        "database) or 'file:///absolute/directory' (a directory every producer and consumer "
        "mounts; written before the commit, orphans removed by retention).",
        json_schema_extra=_group("payloads"),
    )
    encryption_keys: Annotated[EncryptionKeys | None, NoDecode] = Field(
        default=None,
        repr=False,
        description="AES-GCM keys by key id (16, 24 or 32 bytes each), or a callable "
        "returning them (a KMS; called at start and again, at most every "
        "encryption_reload_seconds, when a message names a key id it lacks). The last key "
        "encrypts, every key decrypts. Environment: k1:base64,k2:base64. Set: payloads "
        "(of encryption_streams, default every stream) are encrypted before they reach the "
        "table, the WAL and the broker.",
        json_schema_extra=_group("payloads"),
    )
    encryption_streams: list[str] | None = Field(
        default=None,
        description="With encryption_keys: the streams whose payloads are encrypted (None: "
        "every stream). Consumers decrypt whatever arrives encrypted, whatever this says.",
        json_schema_extra=_group("payloads"),
    )
    encrypted_headers: list[str] = Field(
        default_factory=list,
        description="Names of user headers whose values are encrypted with the payload "
        "(case-insensitive); other headers, the key, the type and the stream stay clear.",
        json_schema_extra=_group("payloads"),
    )
    encryption_reload_seconds: float = Field(
        default=30.0,
        ge=0,
        description="Least time between two calls of a callable encryption_keys when a "
        "message names a key id this process lacks.",
        json_schema_extra=_group("payloads"),
    )

    # -- health --------------------------------------------------------------------------------
    health_max_pending_age_seconds: float = Field(
        default=HEALTH_MAX_PENDING_AGE_SECONDS, gt=0, json_schema_extra=_group("health")
    )
    health_cache_seconds: float = Field(
        default=HEALTH_CACHE_SECONDS, ge=0, json_schema_extra=_group("health")
    )
    health_public_detail: bool = Field(
        default=False,
        description="/outbox/health answers anyone with the detail of /outbox/health/detail "
        "(errors, which name hosts and ports; handler names). False: that detail only "
        "behind dashboard_dependencies.",
        json_schema_extra=_group("health"),
    )
    dashboard_show_payloads: bool = Field(
        default=True,
        description="The dashboard shows message payloads (False: for data that must not be "
        "shown to operators).",
        json_schema_extra=_group("health"),
    )

    # -- wal -----------------------------------------------------------------------------------
    capture: Literal["table", "wal"] = Field(
        default="table",
        description="How the unit of work records messages: 'table' (outbox rows) or 'wal' "
        "(PostgreSQL with wal_level=logical: pg_logical_emit_message in the business "
        "transaction, relayed from a logical replication slot; see fastapi_outbox.relay.wal).",
        json_schema_extra=_group("wal"),
    )
    wal_slot_name: str | None = Field(
        default=None,
        description="Logical replication slot (and publication) of capture='wal'; None: "
        "'fastapi_outbox_<table_name>' in lower case.",
        json_schema_extra=_group("wal"),
    )
    wal_batch_size: int = Field(
        default=WAL_BATCH_SIZE,
        ge=3,
        le=100_000,
        description="pgoutput rows (about 2 + messages per transaction) one read of the slot "
        "asks for; whole transactions are always read.",
        json_schema_extra=_group("wal"),
    )
    wal_standby_poll_seconds: float = Field(
        default=WAL_STANDBY_POLL_SECONDS,
        gt=0,
        description="How often a standby WAL relay tries to take the slot over.",
        json_schema_extra=_group("wal"),
    )
    wal_read_timeout_seconds: float = Field(
        default=WAL_READ_TIMEOUT_SECONDS,
        gt=0,
        description="Bound of one read of the replication slot (the server cancels it); a "
        "read that times out is retried over a window half as large.",
        json_schema_extra=_group("wal"),
    )
    wal_confirm_timeout_seconds: float = Field(
        default=WAL_CONFIRM_TIMEOUT_SECONDS,
        gt=0,
        description="Bound of one confirm of the slot (pg_replication_slot_advance, which "
        "decodes the WAL it moves over).",
        json_schema_extra=_group("wal"),
    )
    wal_read_window_bytes: int = Field(
        default=WAL_READ_WINDOW_BYTES,
        ge=WAL_MIN_READ_WINDOW_BYTES,
        le=1 << 40,
        description="WAL past the slot's confirmed position one read decodes at first; the "
        "window doubles after each read that took under a quarter of "
        "wal_read_timeout_seconds, halves (down to 1 MiB) after one that timed out, and "
        "comes back to this value once the relay has caught up.",
        json_schema_extra=_group("wal"),
    )

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_database_url(value)
        return value

    @field_validator("table_name", "inbox_table_name")
    @classmethod
    def _plain_identifier(cls, value: str) -> str:
        return check_table_name(value)

    @field_validator("archive_table_name")
    @classmethod
    def _archive_identifier(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check_table_name(value)
        except ValueError as exc:
            raise ValueError(str(exc).replace("table_name", "archive_table_name", 1)) from None

    @property
    def archive_name(self) -> str:
        """The effective ``archive_table_name``."""
        return self.archive_table_name or f"{self.table_name}_archive"

    @field_validator("partitioning")
    @classmethod
    def _interval(cls, value: str | None) -> str | None:
        if value is not None:
            parse_interval(value)
        return value

    @field_validator("encryption_keys", mode="before")
    @classmethod
    def _keys_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_encryption_keys(value)
        return value

    @field_validator("encryption_keys")
    @classmethod
    def _key_sizes(cls, value: EncryptionKeys | None) -> EncryptionKeys | None:
        if isinstance(value, dict):
            check_encryption_keys(value)
        return value

    @field_validator("wal_slot_name")
    @classmethod
    def _slot_name(cls, value: str | None) -> str | None:
        if value is not None and not _SLOT_NAME.match(value):
            raise ValueError(
                f"wal_slot_name {value!r} is not a valid replication slot name "
                "(lower-case letters, digits and _, at most 63 characters)"
            )
        return value

    @property
    def slot_name(self) -> str:
        """The effective ``wal_slot_name``."""
        if self.wal_slot_name is not None:
            return self.wal_slot_name
        return f"fastapi_outbox_{self.table_name.lower()}"[:63]

    @model_validator(mode="after")
    def _consistent(self) -> OutboxSettings:
        # Both names and both variables: the error is on neither field alone.
        _no_renamed_variables()
        self._consistent_timing()
        self._consistent_dispatch()
        self._consistent_consumers()
        self._consistent_retention()
        self._consistent_claim_check()
        return self

    def _consistent_claim_check(self) -> None:
        """A claim-check threshold below the largest payload accepted, and a store named
        in a form the outbox knows."""
        if self.claim_check_bytes is not None and self.claim_check_bytes >= self.max_payload_bytes:
            raise ValueError(
                f"claim_check_bytes (OUTBOX_CLAIM_CHECK_BYTES) = {self.claim_check_bytes} is "
                f"not below max_payload_bytes (OUTBOX_MAX_PAYLOAD_BYTES) = "
                f"{self.max_payload_bytes}: no payload would ever be claim-checked; "
                "max_payload_bytes bounds every payload publish() accepts, claim-checked "
                "ones included: raise it"
            )
        store = self.claim_check_store
        if store != "database" and not (store.startswith("file:///") and len(store) > 8):
            raise ValueError(
                f"claim_check_store (OUTBOX_CLAIM_CHECK_STORE) = {store!r}: 'database' or "
                "'file:///absolute/directory'"
            )

    @property
    def claim_check_retention_seconds(self) -> float | None:
        """How long claim-checked payloads are kept: the longer of the published messages'
        retention and the inbox's (None: forever, when either keeps forever)."""
        published, inbox = self.published_retention_seconds, self.inbox_retention_seconds
        if published is None or inbox is None:
            return None
        return max(published, inbox)

    def _consistent_timing(self) -> None:
        """Polls, leases and database timeouts that bound one another."""
        if self.max_poll_interval_seconds < self.poll_interval_seconds:
            raise ValueError(
                "max_poll_interval_seconds (OUTBOX_MAX_POLL_INTERVAL_SECONDS) must be >= "
                "poll_interval_seconds (OUTBOX_POLL_INTERVAL_SECONDS) "
                f"({self.max_poll_interval_seconds} < {self.poll_interval_seconds})"
            )
        if self.lease_seconds < self.publish_timeout_seconds * LEASE_PUBLISH_MARGIN:
            raise ValueError(
                "lease_seconds (OUTBOX_LEASE_SECONDS) must be at least "
                f"{LEASE_PUBLISH_MARGIN} x publish_timeout_seconds "
                "(OUTBOX_PUBLISH_TIMEOUT_SECONDS), so a claim outlives its slowest publish "
                f"and the mark after it ({self.lease_seconds} < "
                f"{LEASE_PUBLISH_MARGIN} x {self.publish_timeout_seconds})"
            )
        if self.statement_timeout_seconds >= self.lease_seconds:
            raise ValueError(
                "db_statement_timeout_seconds (OUTBOX_DB_STATEMENT_TIMEOUT_SECONDS) must be "
                "below lease_seconds (OUTBOX_LEASE_SECONDS): a claim must be recorded while "
                f"its lease holds ({self.statement_timeout_seconds} >= {self.lease_seconds})"
            )
        if self.lock_timeout_seconds > self.statement_timeout_seconds:
            raise ValueError(
                "db_lock_timeout_seconds (OUTBOX_DB_LOCK_TIMEOUT_SECONDS) must be <= "
                "db_statement_timeout_seconds (OUTBOX_DB_STATEMENT_TIMEOUT_SECONDS) "
                f"({self.lock_timeout_seconds} > {self.statement_timeout_seconds})"
            )

    def _consistent_dispatch(self) -> None:
        """Claim sizes, partitioning, retries and the capture."""
        if "min_batch_size" in self.model_fields_set and self.min_batch_size > self.batch_size:
            raise ValueError(
                "min_batch_size (OUTBOX_MIN_BATCH_SIZE) must be <= batch_size "
                f"(OUTBOX_BATCH_SIZE) ({self.min_batch_size} > {self.batch_size})"
            )
        if self.partitioning is not None:
            check_partitioned_table_name(self.table_name)
        if self.retry_max_delay_seconds < self.retry_base_delay_seconds:
            raise ValueError(
                "retry_max_delay_seconds (OUTBOX_RETRY_MAX_DELAY_SECONDS) must be >= "
                "retry_base_delay_seconds (OUTBOX_RETRY_BASE_DELAY_SECONDS) "
                f"({self.retry_max_delay_seconds} < {self.retry_base_delay_seconds})"
            )
        if self.capture == "wal" and self.ordered:
            raise ValueError(
                "capture='wal' (OUTBOX_CAPTURE) cannot be combined with ordered=True "
                "(OUTBOX_ORDERED): the WAL relay publishes in commit order by itself, but a "
                "message the broker refuses leaves that order for the table's retries, so "
                "the per-key blocking of ordered=True cannot be kept"
            )

    def _consistent_retention(self) -> None:
        """Abandoned messages are kept long enough for an operator to replay them; the
        archive's name fits beside the outbox's."""
        if self.archive:
            self._consistent_archive()
        if (
            self.abandoned_retention_seconds is not None
            and self.abandoned_retention_seconds < MIN_ABANDONED_RETENTION_SECONDS
            and not self.allow_short_abandoned_retention
        ):
            raise ValueError(
                "abandoned_retention_seconds (OUTBOX_ABANDONED_RETENTION_SECONDS) is below a "
                f"day ({self.abandoned_retention_seconds:g} < "
                f"{MIN_ABANDONED_RETENTION_SECONDS:g}): abandoned messages were never "
                "delivered, and would be deleted before an operator could replay them; set "
                "allow_short_abandoned_retention=True "
                "(OUTBOX_ALLOW_SHORT_ABANDONED_RETENTION) to mean it"
            )

    def _consistent_consumers(self) -> None:
        if self.consumer_retry_max_delay_seconds >= self.consumer_claim_idle_seconds:
            raise ValueError(
                "consumer_retry_max_delay_seconds (OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS) "
                "must be below consumer_claim_idle_seconds "
                "(OUTBOX_CONSUMER_CLAIM_IDLE_SECONDS): a message waiting for its retry "
                "would be claimed by another consumer "
                f"({self.consumer_retry_max_delay_seconds} >= {self.consumer_claim_idle_seconds})"
            )
        if (
            self.inbox_retention_seconds is not None
            and self.inbox_retention_seconds < self.consumer_redelivery_window_seconds
        ):
            raise ValueError(
                "inbox_retention_seconds (OUTBOX_INBOX_RETENTION_SECONDS) must exceed the "
                "longest redelivery window, consumer_claim_idle_seconds x "
                "(consumer_max_attempts + 1), or a late redelivery is handled twice "
                f"({self.inbox_retention_seconds} < {self.consumer_redelivery_window_seconds})"
            )

    @property
    def consumer_redelivery_window_seconds(self) -> float:
        """How long after its first delivery a message can still be redelivered by the
        broker on its own (not counting replays of dead letters)."""
        return self.consumer_claim_idle_seconds * (self.consumer_max_attempts + 1)

    @property
    def smallest_claim(self) -> int:
        """Claim size of an idle relay: ``min_batch_size``, at most ``batch_size``."""
        return min(self.min_batch_size, self.batch_size)

    @property
    def statement_timeout_seconds(self) -> float:
        """The effective ``db_statement_timeout_seconds``."""
        if self.db_statement_timeout_seconds is not None:
            return self.db_statement_timeout_seconds
        return min(DB_STATEMENT_TIMEOUT_SECONDS, self.lease_seconds / 3)

    @property
    def lock_timeout_seconds(self) -> float:
        """The effective ``db_lock_timeout_seconds``."""
        if self.db_lock_timeout_seconds is not None:
            return self.db_lock_timeout_seconds
        return min(DB_LOCK_TIMEOUT_SECONDS, self.statement_timeout_seconds / 2)

    @classmethod
    def from_env(cls, **overrides: Any) -> OutboxSettings:
        """Settings from ``OUTBOX_*`` variables, with keyword overrides; errors name the setting."""
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise exceptions.ConfigurationError(describe_validation_error(exc)) from exc

    @property
    def dedup_window_seconds(self) -> float:
        """How long brokers must remember a message id: a republish can come after a lease
        expires (crash between publish and mark), after the longest retry backoff, or
        after an outage of the database or the broker (``dedup_outage_seconds``)."""
        return self.dedup_window_needed_seconds + DEDUP_MARGIN_SECONDS

    @property
    def dedup_window_needed_seconds(self) -> float:
        """The shortest de-duplication window a broker may be given (without the margin)."""
        return self.lease_seconds + self.retry_max_delay_seconds + self.dedup_outage_seconds

    def _consistent_archive(self) -> None:
        name = self.archive_name
        if name in (self.table_name, self.inbox_table_name):
            raise ValueError(
                f"archive_table_name (OUTBOX_ARCHIVE_TABLE_NAME) {name!r} is the name of the "
                "outbox or inbox table: the archive needs a table of its own"
            )
        if len(name) > 63:
            raise ValueError(
                f"archive_table_name (OUTBOX_ARCHIVE_TABLE_NAME): the archive of table "
                f"{self.table_name!r} would be {name!r}, longer than 63 characters; set a "
                "shorter archive_table_name"
            )
        if self.partitioning is not None and len(name) > MAX_PARTITIONED_TABLE_NAME:
            raise ValueError(
                f"archive_table_name (OUTBOX_ARCHIVE_TABLE_NAME) {name!r} is too long for a "
                f"partitioned archive: at most {MAX_PARTITIONED_TABLE_NAME} characters"
            )
        if self.delete_on_publish:
            raise ValueError(
                "archive=True (OUTBOX_ARCHIVE) keeps published messages, "
                "delete_on_publish=True (OUTBOX_DELETE_ON_PUBLISH) deletes them at once: "
                "choose one"
            )


#: The async drivers an outbox's database URL may name, per database.
ASYNC_DRIVERS = {
    "postgresql": ("asyncpg", "psycopg", "psycopg_async"),
    "sqlite": ("aiosqlite",),
    # MariaDB >= 10.6 and MySQL 8.
    "mysql": ("asyncmy", "aiomysql"),
}
#: The form to use instead, per database (what the docs and the errors show).
_RIGHT_SCHEME = {
    "postgresql": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
    "mysql": "mysql+asyncmy",
}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\+[A-Za-z0-9_]+)?$")
#: Other spellings of a supported database (``postgres://`` of Heroku, Render, Fly...).
_ALIASES = {
    "postgres": "postgresql",
    "pgsql": "postgresql",
    "sqlite3": "sqlite",
    "mariadb": "mysql",
}


def check_database_url(url: str) -> None:
    """Refuse a database URL SQLAlchemy's asyncio engine cannot use, before any driver sees
    it: ``postgres://`` (no such dialect), a URL without a driver (``postgresql://`` means
    psycopg2, ``sqlite://`` the blocking ``sqlite3``, ``mysql://`` mysqlclient), a blocking
    driver, or a database the outbox does not run on (``oracle://``). The
    `ConfigurationError` names the URL (credentials
    masked) and the form to use."""
    from fastapi_outbox.redaction import redact_url, remember

    remember(url)
    scheme, sep, _ = url.partition("://")
    if not sep and url.endswith(":"):
        scheme, sep = url[:-1], ":"  # ``sqlite+aiosqlite:`` (in memory)
    if not sep or not _SCHEME.match(scheme):
        raise exceptions.ConfigurationError(
            f"database URL {redact_url(url)!r} is not a URL: use "
            "postgresql+asyncpg://host/database or sqlite+aiosqlite:///file.db"
        )
    database, _, driver = scheme.lower().partition("+")
    known = _ALIASES.get(database, database)
    if known not in ASYNC_DRIVERS:
        raise exceptions.ConfigurationError(
            f"database URL {redact_url(url)!r}: {database!r} is not a database the outbox "
            "runs on: use PostgreSQL (postgresql+asyncpg://host/database), "
            "SQLite (sqlite+aiosqlite:///file.db) or MariaDB/MySQL "
            "(mysql+asyncmy://host/database)"
        )
    if known == database and driver in ASYNC_DRIVERS[known]:
        return
    right = redact_url(f"{_RIGHT_SCHEME[known]}{url[len(scheme) :]}")
    if known != database:
        why = f"{database}:// is not SQLAlchemy's name for {known}"
    elif not driver:
        why = "it names no driver, and SQLAlchemy's default one blocks the event loop"
    else:
        why = f"{driver!r} is not an asyncio driver"
    raise exceptions.ConfigurationError(
        f"database URL {redact_url(url)!r}: {why}; use {right!r} "
        f"(drivers: {', '.join(f'{known}+{d}' for d in ASYNC_DRIVERS[known])})"
    )


def check_table_name(value: str) -> str:
    """``value`` when it is a plain SQL identifier, else ``ValueError`` naming ``table_name``.

    The name ends up in index names and the NOTIFY channel as well as the table, so only
    plain identifiers are accepted, not merely quotable ones."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ValueError(
            f"table_name {value!r} is not a plain SQL identifier "
            "(letters, digits and _, not starting with a digit, at most 63 characters)"
        )
    return value


def describe_validation_error(exc: ValidationError) -> str:
    """One line per invalid setting: ``invalid outbox setting 'batch_size': ...``."""
    parts = []
    for error in exc.errors():
        loc = ".".join(str(p) for p in error["loc"])
        if not loc:
            # A cross-field check (model validator): its message names both settings;
            # there is no OUTBOX_SETTINGS variable to point at.
            message = error["msg"].removeprefix("Value error, ")
            parts.append(f"invalid outbox settings: {message}")
            continue
        parts.append(f"invalid outbox setting {loc!r} (OUTBOX_{loc.upper()}): {error['msg']}")
    return "; ".join(parts)


#: Longest table name that leaves room for a partition suffix (``_p202611251200``).
MAX_PARTITIONED_TABLE_NAME = 63 - len("_p202611251200")
_INTERVAL = re.compile(r"^\s*(\d+)\s*([hd])\s*$")


def parse_interval(value: str) -> dt.timedelta:
    """``daily``, ``hourly``, ``6h``, ``2d``… as a timedelta; ``ValueError`` naming the
    setting otherwise. Hours must divide a day, so partitions start at fixed UTC hours."""
    word = {"daily": "1d", "hourly": "1h", "weekly": "7d"}.get(value.strip().lower(), value)
    match = _INTERVAL.match(word.lower())
    if match is None or int(match.group(1)) == 0:
        raise ValueError(
            f"partitioning {value!r} is not an interval: use 'daily', 'hourly', "
            "'weekly' or a number of hours/days such as '6h' or '2d'"
        )
    count, unit = int(match.group(1)), match.group(2)
    if unit == "h" and 24 % count and count % 24:
        raise ValueError(
            f"partitioning {value!r}: a number of hours must divide a day (1, 2, 3, 4, 6, "
            "8, 12) or be whole days"
        )
    return dt.timedelta(hours=count) if unit == "h" else dt.timedelta(days=count)


def check_partitioned_table_name(name: str) -> None:
    if len(name) > MAX_PARTITIONED_TABLE_NAME:
        raise ValueError(
            f"table_name {name!r} is too long for partitioning: at most "
            f"{MAX_PARTITIONED_TABLE_NAME} characters, so partition names stay within "
            "PostgreSQL's 63"
        )


def parse_encryption_keys(text: str) -> dict[str, bytes]:
    """``OUTBOX_ENCRYPTION_KEYS``: ``k1:base64,k2:base64`` (the last one encrypts)."""
    keys: dict[str, bytes] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key_id, sep, encoded = item.partition(":")
        key_id = key_id.strip()
        if not sep:
            raise ValueError(
                f"encryption_keys: {key_id!r} has no key: write key_id:base64 (k1:base64,…)"
            )
        try:
            keys[key_id] = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"encryption_keys: the key of {key_id!r} is not base64") from None
    return check_encryption_keys(keys)


def check_encryption_keys(keys: Mapping[str, bytes]) -> dict[str, bytes]:
    """``keys`` as a dict, each id a header-safe name and each key an AES key; ValueError
    naming the key id otherwise (never the key)."""
    for key_id, key in keys.items():
        if not isinstance(key_id, str) or not ENCRYPTION_KEY_ID.match(key_id):
            raise ValueError(
                f"encryption_keys: invalid key id {key_id!r} (1-64 letters, digits and ._-)"
            )
        if not isinstance(key, bytes) or len(key) not in ENCRYPTION_KEY_SIZES:
            size = len(key) if isinstance(key, bytes) else type(key).__name__
            raise ValueError(
                f"encryption_keys: key {key_id!r} is {size} bytes; AES-GCM takes 16, 24 or 32"
            )
    return dict(keys)
