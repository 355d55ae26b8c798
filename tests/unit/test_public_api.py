"""The public surface of DESIGN §2: names, ``__all__``, ``py.typed``, ``Event`` keywords."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import pytest

import fastapi_outbox
from fastapi_outbox import (
    AggregateRoot,
    Event,
    EventDefinitionError,
    Message,
    Outbox,
    OutboxSettings,
    UnitOfWork,
    UnitOfWorkDep,
    unit_of_work,
)
from fastapi_outbox import brokers as brokers_module
from fastapi_outbox.brokers import (
    MemoryBroker,
    NatsJetStreamBroker,
    RabbitMQBroker,
    RedisStreamsBroker,
)

PACKAGE_DIR = Path(fastapi_outbox.__file__).parent

EXPECTED_ALL = {
    "AggregateRoot",
    "AuthenticationFailed",
    "BrokerRefusing",
    "BrokerUnavailable",
    "ConfigurationError",
    "Envelope",
    "Event",
    "EventDefinitionError",
    "Message",
    "MessageRejected",
    "MessageStatus",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "PayloadTooLarge",
    "PublishError",
    "SerializationError",
    "UnitOfWork",
    "UnitOfWorkDep",
    "UnitOfWorkError",
    "UnknownBroker",
    "__version__",
    "build_table",
    "metadata",
    "outbox_table",
    "unit_of_work",
    "uuid7",
}


def test_design_names_are_importable() -> None:
    # The import block at the top is the contract of DESIGN §2; these are the objects.
    assert isinstance(Outbox, type) and isinstance(OutboxSettings, type)
    assert isinstance(UnitOfWork, type) and callable(unit_of_work)
    assert issubclass(Event, object) and isinstance(AggregateRoot, type)
    assert {MemoryBroker, RedisStreamsBroker, NatsJetStreamBroker, RabbitMQBroker} <= {
        getattr(brokers_module, n) for n in brokers_module.__all__
    }


def test_all_is_exact_and_every_name_resolves() -> None:
    assert set(fastapi_outbox.__all__) == EXPECTED_ALL
    assert len(fastapi_outbox.__all__) == len(EXPECTED_ALL)  # no duplicates
    for name in fastapi_outbox.__all__:
        assert getattr(fastapi_outbox, name) is not None, name
    assert set(brokers_module.__all__) == {
        "Broker",
        "MemoryBroker",
        "NatsJetStreamBroker",
        "PublishResults",
        "RabbitMQBroker",
        "RedisStreamsBroker",
        "broker_from_url",
    }
    for name in brokers_module.__all__:
        getattr(brokers_module, name)


def test_py_typed_is_shipped() -> None:
    marker = PACKAGE_DIR / "py.typed"
    assert marker.is_file()
    # Tracked by git and not ignored: hatchling builds the wheel from the package
    # directory and honours .gitignore, so this is what keeps py.typed in the wheel.
    root = PACKAGE_DIR.parent
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", "fastapi_outbox/py.typed"],
        cwd=root,
        capture_output=True,
        check=False,
    )
    assert tracked.returncode == 0, tracked.stderr
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "fastapi_outbox/py.typed"], cwd=root, check=False
    )
    assert ignored.returncode == 1  # 1 = not ignored
    pyproject = (root / "pyproject.toml").read_text()
    assert 'packages = ["fastapi_outbox"]' in pyproject
    assert '"Typing :: Typed"' in pyproject


def test_event_class_keywords() -> None:
    class OrderPlaced(Event, stream="orders", key="order_id", external=True):
        order_id: int
        total: float

    class Internal(Event, stream="audit"):
        what: str

    message = OrderPlaced(order_id=3, total=9.5).to_message()
    assert (message.stream, message.type, message.key, message.external) == (
        "orders",
        "OrderPlaced",
        "3",
        True,
    )
    assert message.payload == {"order_id": 3, "total": 9.5}
    internal = Internal(what="x").to_message()
    assert (internal.key, internal.external) == (None, False)


def test_event_without_stream_is_refused_at_definition_naming_stream() -> None:
    with pytest.raises(EventDefinitionError) as info:

        class Orphan(Event):
            x: int

    assert "stream" in str(info.value) and "Orphan" in str(info.value)


@pytest.mark.parametrize("stream", ["", "   "])
def test_event_with_empty_stream_is_refused(stream: str) -> None:
    with pytest.raises(EventDefinitionError, match="stream"):

        class Blank(Event, stream=stream):
            x: int


def test_message_is_the_explicit_envelope_for_publish() -> None:
    message = Message(stream="orders", type="Custom", payload={"a": 1}, key="k", headers={"h": "v"})
    assert (message.stream, message.type, message.payload, message.key, message.headers) == (
        "orders",
        "Custom",
        {"a": 1},
        "k",
        {"h": "v"},
    )


def test_unit_of_work_dep_is_an_annotated_alias_of_the_dependency() -> None:
    assert typing.get_origin(UnitOfWorkDep) is typing.Annotated
    origin, depends = typing.get_args(UnitOfWorkDep)
    assert origin is UnitOfWork
    assert depends.dependency is unit_of_work


def test_publish_signature_matches_the_contract() -> None:
    import inspect

    params = inspect.signature(UnitOfWork.publish).parameters
    assert list(params) == [
        "self", "event", "key", "headers", "broker", "delay", "deliver_at"
    ]  # fmt: skip
    for name in ("key", "headers", "broker", "delay", "deliver_at"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default is None


# The house (issue 18): every public module's ``__all__``, pinned. The old flat paths stay
# importable as short re-export modules ("Canonical: <new path>") and keep their names.
PUBLIC_ALL: dict[str, set[str]] = {
    "fastapi_outbox.admin": {
        "PROBLEMS_SHOWN",
        "Progress",
        "add_commands",
        "parse_duration",
        "parse_uuid",
        "read_ids",
        "run",
    },
    "fastapi_outbox.brokers.base": {"Broker", "PublishResults", "redact_url"},
    "fastapi_outbox.payloads": {"Parts", "PayloadStage", "Payloads", "Revealed", "build_payloads"},
    "fastapi_outbox.payloads.claim_check": {
        "ROW_KEY",
        "ClaimCheckStage",
        "human_size",
        "label_of",
        "put_claims",
    },
    "fastapi_outbox.payloads.encryption": {
        "HEADER_ENCRYPTED_HEADERS",
        "HEADER_KEY_ID",
        "EncryptionStage",
        "KeyRing",
    },
    "fastapi_outbox.payloads.pipeline": {"Payloads", "build_payloads"},
    "fastapi_outbox.payloads.stages": {"Parts", "PayloadStage", "Revealed"},
    "fastapi_outbox.brokers.consumer": {
        "Consumer",
        "ConsumerConfig",
        "ConsumerLag",
        "DEAD_LETTER_ERROR",
        "DEAD_LETTER_GROUP",
        "DeadLetter",
        "Delivery",
        "dead_letter_name",
        "parse_headers",
    },
    "fastapi_outbox.brokers.cloudevents": {
        "AMQP_BINARY_PREFIX",
        "BINARY_PREFIX",
        "CONTENT_TYPE_JSON",
        "CONTENT_TYPE_STRUCTURED",
        "DEFAULT_SOURCE",
        "SPECVERSION",
        "CloudEvent",
        "CloudEventsMode",
        "CloudEventsOptions",
        "EnvelopeFormat",
        "as_delivery",
        "attributes",
        "decode",
        "encode",
        "is_cloudevent",
        "to_envelope",
    },
    "fastapi_outbox.brokers.memory": {"MemoryBroker"},
    "fastapi_outbox.brokers.memory.broker": {"MemoryBroker"},
    "fastapi_outbox.brokers.memory.connection": {"MemoryConnection"},
    "fastapi_outbox.brokers.memory_consumer": {"MemoryConsumer"},
    "fastapi_outbox.brokers.nats": {
        "ACK_TIMEOUT_SECONDS",
        "CONNECT_TIMEOUT_SECONDS",
        "DEDUP_WINDOW_SECONDS",
        "JS_API_INFO",
        "KEY_HEADER",
        "MSG_ID_HEADER",
        "NO_RESPONDERS_STATUS",
        "NatsJetStreamBroker",
        "REFUSAL_ERR_CODES",
        "STREAM_MAX_AGE_SECONDS",
        "STREAM_MAX_BYTES",
        "refusal_reason",
        "stream_name_for",
    },
    "fastapi_outbox.brokers.nats.broker": {"NatsJetStreamBroker"},
    "fastapi_outbox.brokers.nats.connection": {
        "ACK_TIMEOUT_SECONDS",
        "CONNECT_TIMEOUT_SECONDS",
        "DEDUP_WINDOW_SECONDS",
        "JS_API_INFO",
        "MAX_OUTSTANDING_PINGS",
        "PING_INTERVAL_SECONDS",
        "RECONNECT_WAIT_SECONDS",
        "STREAM_MAX_AGE_SECONDS",
        "STREAM_MAX_BYTES",
        "NatsConnection",
    },
    "fastapi_outbox.brokers.nats.wire": {
        "KEY_HEADER",
        "MSG_ID_HEADER",
        "NO_RESPONDERS_STATUS",
        "REFUSAL_ERR_CODES",
        "ack_error",
        "decode_message",
        "exceeds_max_payload",
        "header_block",
        "hpub_command",
        "invalid_subject",
        "is_unreachable",
        "publish_headers",
        "refusal_reason",
        "sequence_and_count",
        "stream_name_for",
        "wire_size",
    },
    "fastapi_outbox.brokers.nats_consumer": {
        "API_TIMEOUT_SECONDS",
        "DEAD_LETTER_SCAN",
        "NatsJetStreamConsumer",
        "durable_name",
    },
    "fastapi_outbox.brokers.rabbitmq": {
        "CONFIRM_TIMEOUT_SECONDS",
        "CONNECT_TIMEOUT_SECONDS",
        "DEFAULT_EXCHANGE",
        "DEFAULT_URL",
        "KEY_HEADER",
        "QUEUE_TEMPLATE",
        "RabbitMQBroker",
        "RabbitMQConnection",
        "outage",
    },
    "fastapi_outbox.brokers.rabbitmq.broker": {"RabbitMQBroker"},
    "fastapi_outbox.brokers.rabbitmq.connection": {
        "CONFIRM_TIMEOUT_SECONDS",
        "CONNECT_TIMEOUT_SECONDS",
        "HEARTBEAT_SECONDS",
        "RabbitMQConnection",
    },
    "fastapi_outbox.brokers.rabbitmq.consumer": {
        "DEAD_LETTER_ID",
        "DEAD_LETTER_SCAN",
        "DEFAULT_PREFETCH",
        "DELIVERY_LIMIT",
        "RabbitMQConsumer",
    },
    "fastapi_outbox.brokers.rabbitmq.publisher": {
        "DEFAULT_EXCHANGE",
        "DEFAULT_URL",
        "RabbitMQPublisher",
    },
    "fastapi_outbox.brokers.rabbitmq.wire": {
        "BROKER_HEADERS",
        "CONTENT_TYPE",
        "DELIVERY_COUNT_HEADER",
        "KEY_HEADER",
        "QUEUE_TEMPLATE",
        "cloudevent_headers",
        "cloudevent_message",
        "delivery_attempt",
        "header_problem",
        "message_headers",
        "message_identity",
        "outage",
        "queue_name",
        "user_headers",
    },
    "fastapi_outbox.brokers.redis": {
        "DEDUP_WINDOW_SECONDS",
        "DedupMode",
        "IDMP_MAX_DURATION_SECONDS",
        "IDMP_MAX_SIZE",
        "IDMP_PRODUCERS",
        "REFUSAL_CODES",
        "RedisStreamsBroker",
        "SCRIPT_CHUNK",
        "refusal_code",
    },
    "fastapi_outbox.brokers.redis.broker": {"RedisStreamsBroker"},
    "fastapi_outbox.brokers.redis.connection": {
        "CLUSTER_SCHEMES",
        "RedisConnection",
        "SOCKET_TIMEOUT_SECONDS",
        "cluster_startup_nodes",
        "cluster_url",
        "is_cluster_url",
    },
    "fastapi_outbox.brokers.redis.wire": {
        "PUBLISHED_FIELDS",
        "REFUSAL_CODES",
        "dead_letter_key",
        "decode_entry",
        "dedup_key",
        "entry_fields",
        "entry_values",
        "hashed_part",
        "is_unreachable",
        "refusal_code",
        "reply_entries",
        "same_slot",
        "slot_tag",
        "text",
    },
    "fastapi_outbox.brokers.setup": {
        "DEFAULT_BROKER",
        "NO_BROKER",
        "BrokerSetup",
        "resolve_broker",
        "setup_brokers",
    },
    "fastapi_outbox.brokers.redis_consumer": {
        "AUTOCLAIM_COUNT",
        "DEAD_LETTER_SCAN",
        "DEAD_LETTER_SCRIPT",
        "RedisStreamsConsumer",
        "trimmed_unread",
    },
    "fastapi_outbox.capture": {"Capture", "TableCapture"},
    "fastapi_outbox.cli": {
        "BROKER_URL_ENV",
        "build_parser",
        "configure_logging",
        "dispatch",
        "load_outbox",
        "main",
        "resolve_outbox",
    },
    "fastapi_outbox.cli.asyncapi": {"add_command", "run"},
    "fastapi_outbox.cli_support": {
        "CliError",
        "EXIT_FAILED",
        "EXIT_OK",
        "EXIT_UNREACHABLE",
        "EXIT_USAGE",
        "confirm",
        "destructive_options",
        "guard",
        "operator_name",
        "render_table",
        "sqlstate",
        "target",
    },
    "fastapi_outbox.clock": {
        "age_seconds",
        "db_later",
        "db_now",
        "seconds_modifier",
        "utcnow",
        "wall",
    },
    "fastapi_outbox.config_checks": {
        "SUPPORTED_DIALECTS",
        "check_broker_names",
        "check_database",
        "check_dedup_window",
        "check_partitioning",
        "check_wal_capture",
    },
    "fastapi_outbox.consume.batches": {"BATCH_HANDLER_TRIES", "Batches"},
    "fastapi_outbox.consume.context": {"ConsumeContext", "UnitOfWorkT"},
    "fastapi_outbox.consume.entry": {"HandlerT", "subscribe"},
    "fastapi_outbox.consume.handlers": {
        "BatchUnitOfWork",
        "Decoder",
        "Handler",
        "HandlerSignature",
        "NotForHandler",
        "Undeliverable",
        "UnknownType",
        "correlation_of",
        "delivery_context",
        "event_classes",
        "inspect_handler",
    },
    "fastapi_outbox.consume.versions": {
        "HAND_BACK_SECONDS",
        "HEARTBEAT_SECONDS",
        "MEMBER_TTL_SECONDS",
        "Versions",
    },
    "fastapi_outbox.consume.options": {
        "DEAD_LETTER_TEMPLATE",
        "check_batch_handler",
        "check_options",
        "check_streams",
        "describe",
        "subscriber_options",
    },
    "fastapi_outbox.consume.partitioned": {
        "PARTITION_QUEUE_MAX",
        "PartitionedRun",
        "can_read_partitions",
        "fair_share",
        "partition_of",
        "rebalance",
    },
    "fastapi_outbox.consume.processing": {
        "BeforeAttempt",
        "DATABASE_PING_SECONDS",
        "Fence",
        "HandlerRun",
        "InFlight",
        "PAUSE_MAX_SECONDS",
        "PAUSE_MIN_SECONDS",
        "Processing",
        "ProcessingOptions",
        "ReleasedAtStop",
        "Spoiled",
        "SubscriberStats",
        "UNWRITTEN_DEAD_LETTERS_KEPT",
        "escaped",
        "harvest_added",
        "pause_for",
        "stops_the_process",
    },
    "fastapi_outbox.consume.subscriber": {
        "BatchUnitOfWork",
        "ConsumerStatus",
        "DEAD_LETTER_TEMPLATE",
        "Subscriber",
        "SubscriberStats",
    },
    "fastapi_outbox.consumers_cli": {
        "EXIT_OK",
        "add_commands",
        "add_replay_arguments",
        "replay",
        "run",
    },
    "fastapi_outbox.dashboard": {"CSRF_COOKIE", "CSRF_HEADER", "build_dashboard_router"},
    "fastapi_outbox.dashboard.router": {"CSRF_COOKIE", "CSRF_HEADER", "build_dashboard_router"},
    "fastapi_outbox.db_outage": {
        "PING_SECONDS",
        "Verdict",
        "classify",
        "classify_postgresql",
        "classify_sqlite",
        "database_answers",
        "is_outage",
        "sqlstate_of",
    },
    "fastapi_outbox.dispatcher": {
        "DB_BACKOFF_MAX_SECONDS",
        "DB_BACKOFF_MIN_SECONDS",
        "PROBE_TIMEOUT_SECONDS",
        "Processor",
        "RELEASE_TIMEOUT_SECONDS",
        "instance_id",
        "process_batch",
        "retry_delay",
    },
    "fastapi_outbox.doctor": {
        "DOCTOR_AHEAD_SECONDS",
        "Finding",
        "LOCK_NOT_AVAILABLE",
        "OBSOLETE_COLUMNS",
        "UPGRADE_LOCK_ATTEMPTS",
        "UPGRADE_LOCK_TIMEOUT_SECONDS",
        "UPGRADE_RETRY_PAUSE_SECONDS",
        "UpgradeLockTimeout",
        "examine",
        "examine_sync",
        "upgrade",
    },
    "fastapi_outbox.events": {
        "Envelope",
        "Event",
        "HEADER_CAUSATION_ID",
        "HEADER_CORRELATION_ID",
        "HEADER_ENCRYPTED_HEADERS",
        "HEADER_ENCRYPTION_KEY_ID",
        "HEADER_MESSAGE_ID",
        "HEADER_OCCURRED_AT",
        "HEADER_TRACEPARENT",
        "HEADER_TYPE",
        "Message",
        "MessageStatus",
        "uuid7",
    },
    "fastapi_outbox.health": {
        "HEALTH_TIMEOUT_SECONDS",
        "NO_GUARD",
        "OutboxHealth",
        "RelayHealth",
        "Status",
        "WalHealth",
        "build_health_router",
        "compute_health",
    },
    "fastapi_outbox.inbox": {"Inbox", "build_inbox_table", "inbox_table"},
    "fastapi_outbox.instrumentation": {"Instrumentation", "PublishFinisher", "PublishOutcome"},
    "fastapi_outbox.lifecycle.groups": {
        "DECLARE_GROUPS_TIMEOUT_SECONDS",
        "GroupsFirst",
        "declare_groups",
        "declare_or_warn",
        "gate_brokers",
    },
    "fastapi_outbox.lifecycle.supervisor": {
        "Lifecycle",
        "Service",
        "StoppableService",
        "Supervisor",
        "close_brokers",
    },
    "fastapi_outbox.log": {
        "ERROR_MAX_CHARS",
        "JsonFormatter",
        "TextFormatter",
        "redact",
        "safe_error",
        "stack",
    },
    "fastapi_outbox.metrics": {"PrometheusInstrumentation", "metrics_router", "mount_metrics"},
    "fastapi_outbox.notify": {
        "Listener",
        "Notifier",
        "PING_PREFIX",
        "RECONNECT_MAX_SECONDS",
        "RECONNECT_MIN_SECONDS",
        "RELEASE_TIMEOUT_SECONDS",
        "Wakeup",
        "channel_name",
        "set_keepalive",
    },
    "fastapi_outbox.operations": {
        "ABANDONABLE",
        "CANCELLABLE",
        "CONSUMER_QUERY_TIMEOUT_SECONDS",
        "ID_PAGE_SIZE",
        "MAX_IDS",
        "MAX_PAGE_SIZE",
        "MessageFilter",
        "Outcome",
        "Overview",
        "REPLAYABLE",
        "REPLAY_BATCH_SIZE",
        "STALE_SCAN",
        "STATUS_FILTERS",
        "abandon",
        "cancel",
        "checked_ids",
        "consumers",
        "dead_letters",
        "find_subscriber",
        "list_messages",
        "overview",
        "purge",
        "replay",
        "replay_abandoned",
        "replay_dead_letters",
        "show",
        "stale_dead_letters",
    },
    "fastapi_outbox.ops.routers": {"NO_DASHBOARD_GUARD", "Routers"},
    "fastapi_outbox.ops.dashboard": {"CSRF_COOKIE", "CSRF_HEADER", "build_dashboard_router"},
    "fastapi_outbox.ops.asyncapi": {
        "ASYNCAPI_PATH",
        "ASYNCAPI_VERSION",
        "AsyncApiSource",
        "build_asyncapi",
        "build_asyncapi_router",
        "event_classes",
    },
    "fastapi_outbox.ops.metrics": {"PrometheusInstrumentation", "metrics_router", "mount_metrics"},
    "fastapi_outbox.partitions": {
        "AHEAD_SECONDS",
        "AUTOVACUUM",
        "LOCK_TIMEOUT_SECONDS",
        "MAX_TABLE_NAME",
        "Maintainer",
        "Partition",
        "Reactivated",
        "check_table_name",
        "create_default_sync",
        "create_partition_sync",
        "default_name",
        "drop_partition_sync",
        "ensure_ahead_sync",
        "expired_candidates",
        "install",
        "list_partitions",
        "parse_interval",
        "partition_name",
        "ranges_to_create",
        "statements",
        "storage_sql",
        "wanted_ranges",
    },
    "fastapi_outbox.redaction": {"MASK", "redact", "redact_url", "remember", "split_url_list"},
    "fastapi_outbox.backoff": {"exponential_delay"},
    "fastapi_outbox.relay.ordered": {"publish_ordered"},
    "fastapi_outbox.relay.outcomes": {"NotAttempted", "Outcomes", "retry_delay"},
    "fastapi_outbox.relay.relays": {"Relays", "Start"},
    "fastapi_outbox.relay_loop": {"RelayLoop"},
    "fastapi_outbox.retention": {"BATCH_PAUSE_SECONDS", "Cleaner", "purge"},
    "fastapi_outbox.schema": {"build_table", "ddl", "metadata", "outbox_table"},
    "fastapi_outbox.session_events": {"JOINED_KEY", "STATE_KEY", "SessionState", "state_of"},
    "fastapi_outbox.storage.claims": {
        "ClaimedRow",
        "Claims",
        "ERROR_MAX_CHARS",
        "Failure",
        "UNDEFINED_TABLE",
    },
    "fastapi_outbox.storage.clock": {
        "age_seconds",
        "db_later",
        "db_now",
        "seconds_modifier",
        "utcnow",
        "wall",
    },
    "fastapi_outbox.storage.connector": {
        "Connector",
        "Held",
        "commit_with",
        "row_count",
    },
    "fastapi_outbox.storage.db_outage": {
        "AUTHENTICATION_FIX",
        "PING_SECONDS",
        "TABLE_MISSING_FIX",
        "Verdict",
        "classify",
        "classify_postgresql",
        "classify_sqlite",
        "database_answers",
        "describe",
        "is_outage",
        "sqlstate_of",
    },
    "fastapi_outbox.storage.dialects": {
        "is_postgres",
        "uses_asyncpg",
    },
    "fastapi_outbox.storage.engine": {
        "POOL_MAX_OVERFLOW",
        "POOL_SIZE",
        "SQLITE_BUSY_TIMEOUT_MS",
        "SQLITE_CONNECT_TIMEOUT_SECONDS",
        "create_engine",
        "PG_CONNECT_TIMEOUT_SECONDS",
        "PG_KEEPALIVE_IDLE_SECONDS",
        "PG_KEEPALIVE_INTERVAL_SECONDS",
        "PG_KEEPALIVE_PROBES",
        "engine_defaults",
        "is_postgres",
        "uses_asyncpg",
    },
    "fastapi_outbox.storage.claim_check": {
        "HEADER_CLAIM_CHECK",
        "HEADER_CLAIM_CHECK_SIZE",
        "ORPHAN_GRACE_SECONDS",
        "STUB_PAYLOAD",
        "DatabasePayloadStore",
        "FilePayloadStore",
        "PayloadStore",
        "build_payload_table",
        "known_in",
        "live_in",
        "payload_store_for",
    },
    "fastapi_outbox.storage.filters": {
        "MessageFilter",
        "SCHEDULED",
        "STATUS_FILTERS",
    },
    "fastapi_outbox.storage.inbox": {"Inbox", "build_inbox_table", "inbox_table"},
    "fastapi_outbox.storage.group_members": {
        "ANY_TYPE",
        "Attempts",
        "GroupMembers",
        "build_group_tables",
    },
    "fastapi_outbox.storage.inserts": {
        "Inserts",
    },
    "fastapi_outbox.storage.leases": {
        "LeaseLost",
        "Leases",
        "OwnedPartition",
        "build_lease_tables",
    },
    "fastapi_outbox.storage.messages": {
        "Messages",
    },
    "fastapi_outbox.storage.partition_map": {"FLOOR_SECONDS", "NIL", "PartitionMap", "Range"},
    "fastapi_outbox.storage.read_models": {
        "BrokerStats",
        "age",
        "aware",
        "broker_stats",
        "per_minute",
        "stream_stats",
    },
    "fastapi_outbox.storage.retention": {
        "Retention",
    },
    "fastapi_outbox.storage.schema": {
        "build_archive_table",
        "build_table",
        "ddl",
        "ddl_statements",
        "metadata",
        "outbox_table",
    },
    "fastapi_outbox.storage.archive": {"Archive"},
    "fastapi_outbox.storage.statements.archive": {
        "PARTITION_BOUND",
        "PARTITION_OF",
        "add_archived_at",
        "archive_busy",
        "archived_at_index",
        "attach_as",
        "copy_rows",
        "move",
        "move_delete",
        "move_insert",
        "purge",
    },
    "fastapi_outbox.storage.statements.schema_check": {
        "COLUMNS",
        "INDEXES",
        "RELKIND",
        "RELOPTIONS",
        "RESET_LOCK_TIMEOUT",
        "SQLITE_INDEXES",
        "add_column",
        "alter_type",
        "create_index",
        "drop_column",
        "drop_index",
        "lock_timeout",
        "probe_index",
        "probe_table",
        "rename_in_create",
        "rename_index",
        "set_not_null",
        "set_storage",
        "sqlite_columns",
    },
    "fastapi_outbox.storage.statements.session": {
        "BEGIN_IMMEDIATE",
        "PING",
        "sqlite_pragmas",
    },
    "fastapi_outbox.storage.setup": {
        "Storage",
        "build_outbox_table",
        "open_engine",
        "setup_storage",
    },
    "fastapi_outbox.storage.statements.messages": {
        "abandon_unclaimed",
        "blocking_ordered",
        "cancel_unclaimed",
        "count",
        "count_matching",
        "database_now",
        "get",
        "list_messages",
        "ping",
        "published_per_minute",
        "replay",
        "states",
        "stats",
        "stream_stats",
        "waiting_ordered",
    },
    "fastapi_outbox.storage.statements.parts": {
        "ABANDONED",
        "ACTIVE",
        "ERROR_MAX_CHARS",
        "FAILED",
        "PENDING",
        "PROCESSING",
        "PUBLISHED",
        "active",
        "batch_params",
        "ids_in",
        "later",
        "now",
        "offset",
        "order_columns",
        "status_in",
    },
    "fastapi_outbox.storage.statements.partitions": {
        "ACTIVE_SQL",
        "AUTOVACUUM",
        "DB_NOW",
        "KEY_CREATED_AT",
        "KEY_ID",
        "PARTITION_KEY",
        "RELATION_EXISTS",
        "RELATION_MISSING",
        "TRY_LOCK",
        "UTC",
        "active_partitions",
        "any_active",
        "attach",
        "bound_literal",
        "bound_value",
        "busy",
        "create_default",
        "create_like",
        "default_has_rows",
        "detach",
        "drop",
        "id_bound",
        "list_partitions",
        "lock_timeout",
        "partition_of",
        "quote",
        "storage_sql",
    },
    "fastapi_outbox.storage.statements.claims": {
        "CLAIM_COLUMNS",
        "claim",
        "extend_lease",
        "generic_plan",
        "has_floor",
        "insert_failed",
        "local_timeouts",
        "mark_failed",
        "mark_published",
        "next_due",
        "ordered_turn",
        "release",
        "transaction_bounds",
    },
    "fastapi_outbox.storage.statements.payloads": {
        "fetch",
        "insert_payload",
        "known_messages",
        "live_messages",
        "purge",
    },
    "fastapi_outbox.storage.statements.purge": {
        "purge",
        "victims",
    },
    "fastapi_outbox.storage.statements.notify": {
        "NOTIFY_SQL",
        "notify",
        "notify_with_commit",
    },
    "fastapi_outbox.storage.statements.wal": {
        "ADVANCE_SQL",
        "BOUNDARY_SQL",
        "CHECK_SQL",
        "CREATE_SLOT_SQL",
        "DB_NOW_SQL",
        "DROP_SLOT_SQL",
        "PEEK_SQL",
        "PUBLICATION_EXISTS_SQL",
        "SESSION_SQL",
        "SLOT_EXISTS_SQL",
        "STATS_SQL",
        "TRY_LOCK_SQL",
        "check_ready",
    },
    "fastapi_outbox.storage.statements.inserts": {
        "EMIT_SQL",
        "INSERT_KEYS",
        "emit_message",
        "insert_rows",
        "row_params",
    },
    "fastapi_outbox.storage.probe": {"DatabaseProbe", "POOL_PROBE_SECONDS", "PoolUsage"},
    "fastapi_outbox.storage.store": {
        "ABANDONED",
        "BrokerStats",
        "ClaimedRow",
        "ERROR_MAX_CHARS",
        "FAILED",
        "Failure",
        "INSERT_KEYS",
        "PENDING",
        "PROCESSING",
        "PUBLISHED",
        "Store",
    },
    "fastapi_outbox.storage.types": {
        "ACTIVE_STATUSES",
        "JsonText",
        "UtcDateTime",
    },
    "fastapi_outbox.storage.wal_slot": {
        "Read",
        "SlotStats",
        "Transaction",
        "Undecodable",
        "UndecodableWalMessage",
        "WalMessage",
        "WalSlot",
        "decode",
        "encode",
    },
    "fastapi_outbox.store": {
        "ABANDONED",
        "BrokerStats",
        "ClaimedRow",
        "ERROR_MAX_CHARS",
        "FAILED",
        "Failure",
        "INSERT_KEYS",
        "PENDING",
        "PROCESSING",
        "PUBLISHED",
        "Store",
    },
    "fastapi_outbox.subscribers": {
        "BatchUnitOfWork",
        "ConsumerStatus",
        "DEAD_LETTER_TEMPLATE",
        "Subscriber",
        "SubscriberStats",
    },
    "fastapi_outbox.testing": {"OutboxHarness", "drain", "memory_broker", "sqlite_outbox"},
    "fastapi_outbox.unit_of_work": {"UnitOfWork", "UnitOfWorkDep", "unit_of_work"},
    "fastapi_outbox.wal_capture": {"WalCapture"},
    "fastapi_outbox.wal_relay": {
        "DB_BACKOFF_MAX_SECONDS",
        "DB_BACKOFF_MIN_SECONDS",
        "SLOT_IN_USE",
        "SLOT_IN_USE_PAUSE_SECONDS",
        "TIMEOUT_MARGIN_SECONDS",
        "WalRelay",
    },
    "fastapi_outbox.wal_slot": {
        "Read",
        "SlotStats",
        "Transaction",
        "Undecodable",
        "UndecodableWalMessage",
        "WalMessage",
        "WalSlot",
        "decode",
        "encode",
    },
    "fastapi_outbox.write.capture": {"Capture", "TableCapture", "capture_for"},
    "fastapi_outbox.write.commit": {"commit", "roll_back"},
    "fastapi_outbox.write.producer": {"Producer"},
    "fastapi_outbox.write.session_events": {"JOINED_KEY", "STATE_KEY", "SessionState", "state_of"},
    "fastapi_outbox.write.unavailable": {"RETRY_AFTER_SECONDS", "unavailable"},
    "fastapi_outbox.write.unit_of_work": {
        "HANDLER_TRANSACTION",
        "HandlerTransaction",
        "UnitOfWork",
        "UnitOfWorkDep",
        "activate",
        "close",
        "transaction",
        "unit_of_work",
    },
    "fastapi_outbox.write.wal_capture": {"WalCapture"},
}

CAPABILITY_PACKAGES = [
    "fastapi_outbox.storage",
    "fastapi_outbox.payloads",
    "fastapi_outbox.write",
    "fastapi_outbox.relay",
    "fastapi_outbox.consume",
    "fastapi_outbox.ops",
    "fastapi_outbox.cli",
    "fastapi_outbox.brokers",
    "fastapi_outbox.brokers.redis",
    "fastapi_outbox.brokers.nats",
    "fastapi_outbox.brokers.memory",
]


def _public_modules() -> list[str]:
    import pkgutil

    names = (m.name for m in pkgutil.walk_packages(fastapi_outbox.__path__, "fastapi_outbox."))
    return sorted(n for n in names if n != "fastapi_outbox.__main__")


def test_every_public_module_all_is_pinned_and_resolves() -> None:
    import importlib

    found = {}
    for name in _public_modules():
        module = importlib.import_module(name)
        if hasattr(module, "__all__") and name != "fastapi_outbox.brokers":
            assert len(module.__all__) == len(set(module.__all__)), name  # no duplicates
            found[name] = set(module.__all__)
            for attr in module.__all__:
                assert getattr(module, attr) is not None, f"{name}.{attr}"
    assert found == PUBLIC_ALL


def test_old_paths_re_export_the_canonical_objects() -> None:
    import importlib

    old_paths = 0
    for name in _public_modules():
        module = importlib.import_module(name)
        doc = module.__doc__ or ""
        if not doc.startswith("Canonical: "):
            continue
        old_paths += 1
        canonical = importlib.import_module(doc.removeprefix("Canonical: ").split()[0])
        assert canonical is not module
        for attr in module.__all__:
            assert getattr(module, attr) is getattr(canonical, attr), f"{name}.{attr}"
    # every flat module that moved (the broker modules and cli became packages that re-export)
    assert old_paths == 29


def test_each_capability_package_says_what_it_owns() -> None:
    import importlib

    for name in CAPABILITY_PACKAGES:
        doc = importlib.import_module(name).__doc__
        assert doc and len(doc.split()) >= 15, name


def test_old_module_path_does_not_shadow_the_unit_of_work_dependency() -> None:
    # ``fastapi_outbox.unit_of_work`` is both the dependency and an old module path.
    code = (
        "import fastapi_outbox.unit_of_work, fastapi_outbox, inspect\n"
        "from fastapi_outbox.unit_of_work import UnitOfWork\n"
        "assert inspect.isfunction(fastapi_outbox.unit_of_work), fastapi_outbox.unit_of_work\n"
        "from fastapi_outbox.cli import main\n"
        "assert inspect.isfunction(main)\n"
    )
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
