"""The ``fastapi-outbox`` command (also ``python -m fastapi_outbox``).

The database comes from ``--url``, from ``--app module:outbox`` (an
[`Outbox`][fastapi_outbox.Outbox] in an
importable module, brokers included) or from ``OUTBOX_DATABASE_URL``. Exit codes: 0
success, 1 failure of the operation (unknown message id, missing table), 2 usage or
configuration error (bad duration, no database given), 3 database unreachable. Errors
name what they are about and never print a password.

Logs go to stderr, as text (``key=value`` extras) or, with ``--log-format json``, one
JSON object per line ([`fastapi_outbox.log.JsonFormatter`][fastapi_outbox.JsonFormatter]).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.setup import NO_BROKER
from fastapi_outbox.cli.support import (
    EXIT_AUTHENTICATION,
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    broker_error,
)
from fastapi_outbox.cli.support import guard as _guard
from fastapi_outbox.cli.support import sqlstate as _sqlstate
from fastapi_outbox.log import JsonFormatter, TextFormatter, safe_error
from fastapi_outbox.outbox import Outbox, side_tables
from fastapi_outbox.redaction import redact, redact_url
from fastapi_outbox.settings import OutboxSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

#: Broker of ``dispatch --url`` when no ``--broker-url`` is given.
BROKER_URL_ENV = "OUTBOX_BROKER_URL"

logger = logging.getLogger("fastapi_outbox.cli")


def load_outbox(spec: str) -> Outbox:
    """Import ``module:attribute`` and return the Outbox it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CliError(f"--app must look like 'package.module:outbox', got {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"--app {spec}: cannot import {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise CliError(f"--app {spec}: {module_name!r} has no attribute {attr!r}") from exc
    if callable(obj) and not isinstance(obj, Outbox):
        obj = obj()
    if not isinstance(obj, Outbox):
        raise CliError(f"--app {spec} is a {type(obj).__name__}, not an Outbox")
    return obj


def resolve_outbox(args: argparse.Namespace) -> Outbox:
    """The Outbox the command works on: ``--app``, else ``--url``/``OUTBOX_DATABASE_URL``."""
    if getattr(args, "app", None):
        return load_outbox(args.app)
    try:
        settings = OutboxSettings.from_env(
            **({"table_name": args.table} if getattr(args, "table", None) else {})
        )
    except exceptions.ConfigurationError as exc:
        raise CliError(str(exc)) from exc
    url = getattr(args, "url", None) or settings.database_url
    if not url:
        raise CliError("no database: pass --url, --app module:outbox or set OUTBOX_DATABASE_URL")
    brokers = None
    # Without --broker-url, Outbox() takes OUTBOX_BROKER_URL from the settings.
    broker_url = getattr(args, "broker_url", None)
    try:
        if broker_url:
            from fastapi_outbox.brokers import broker_from_url

            brokers = {"default": broker_from_url(broker_url)}
        return Outbox(url, brokers=brokers, settings=settings)
    except exceptions.OutboxError as exc:
        raise CliError(redact(str(exc))) from exc


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="database URL (else OUTBOX_DATABASE_URL)")
    parser.add_argument("--app", help="module:attribute naming an Outbox")
    parser.add_argument("--table", help="outbox table name (default from settings)")
    parser.add_argument(
        "--tenant",
        help="a multi-tenant --app: the tenant to work on (all: every tenant, for db "
        "create, db upgrade, doctor and purge)",
    )


def _progress_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr (default: only when stderr is a terminal)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastapi-outbox", description="Operate a fastapi-outbox transactional outbox."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="log lines on stderr"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _db_commands(sub)
    dispatch = sub.add_parser("dispatch", help="run the relays without a web server")
    _common(dispatch)
    dispatch.add_argument(
        "--broker-url",
        help=(
            "broker of --url (redis://, redis+cluster://, nats://, amqp://, kafka://; else "
            f"{BROKER_URL_ENV}); --app brings its own"
        ),
    )
    dispatch.add_argument(
        "--http",
        metavar="HOST:PORT",
        type=_host_port,
        help="also serve GET /outbox/health (and /metrics with PrometheusInstrumentation) "
        "on HOST:PORT, for probes of a relay-only process (needs uvicorn)",
    )

    from fastapi_outbox.cli import admin

    admin.add_commands(sub, _common, _progress_option)
    from fastapi_outbox.cli import consumers as consumers_cli

    consumers_cli.add_commands(sub, _common)
    from fastapi_outbox.cli import asyncapi

    asyncapi.add_command(sub)
    return parser


def _db_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``db create``, ``db drop-slot``, ``db sql``, ``db upgrade`` and ``doctor``."""
    db = sub.add_parser("db", help="create the outbox table or print its DDL")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    create = db_sub.add_parser("create", help="create the outbox table and indexes")
    _common(create)
    drop_slot = db_sub.add_parser(
        "drop-slot",
        help="drop the replication slot and publication of capture='wal' (refused while "
        "the slot still holds messages, unless --force)",
    )
    _common(drop_slot)
    drop_slot.add_argument(
        "--force", action="store_true", help="drop it even with unrelayed messages (lost)"
    )
    sql = db_sub.add_parser("sql", help="print the DDL")
    _common(sql)
    sql.add_argument(
        "--dialect",
        choices=["postgresql", "sqlite", "mysql"],
        help="dialect when no --url is given (mysql: MariaDB and MySQL)",
    )
    upgrade = db_sub.add_parser(
        "upgrade",
        help="bring a table made by an earlier release to the current layout (idempotent)",
    )
    _common(upgrade)
    doctor = sub.add_parser(
        "doctor",
        help="compare the live table with the expected layout and print the SQL that fixes "
        "it (exit 1 on a mismatch)",
    )
    _common(doctor)


def configure_logging(fmt: str, verbose: bool) -> None:
    """Log to stderr as text or JSON lines; the library's records carry ``action`` & ids."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        # Driver chatter (SQLAlchemy pool, brokers' clients) only with -v.
        for name in ("sqlalchemy", "asyncio", "nats", "redis"):
            logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format, args.verbose)
    try:
        return asyncio.run(_run(args))
    except CliError as exc:
        print(f"fastapi-outbox: error: {redact(str(exc))}", file=sys.stderr)
        return exc.code
    except exceptions.AuthenticationFailed as exc:  # a broker refused the credentials
        print(f"fastapi-outbox: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_AUTHENTICATION
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # an unexpected failure: say what, without data
        if args.verbose:
            logger.exception("command failed", extra={"action": "cli.failed"})
        print(f"fastapi-outbox: error: {safe_error(exc)}", file=sys.stderr)
        return EXIT_FAILED


async def _run(args: argparse.Namespace) -> int:

    if args.command == "asyncapi":  # builds a document; connects to nothing
        from fastapi_outbox.cli import asyncapi

        return asyncapi.run(args, load_outbox(args.app))
    if args.command == "db" and args.db_command == "sql" and not args.url and not args.app:
        return _print_ddl(args)
    outbox = resolve_outbox(args)
    try:
        targets = await _tenant_targets(args, outbox)
        if targets is None:
            return await _command(args, outbox)
        code = EXIT_OK
        for name, part in targets:
            if len(targets) > 1:
                print(f"== tenant {name}")
            code = max(code, await _command(args, part))
            if outbox.tenants is not None and len(targets) > 1:
                await outbox.tenants.rest(name)
        return code
    finally:
        await outbox.aclose()


#: The commands ``--tenant all`` runs for every tenant, one after the other.
ALL_TENANTS_COMMANDS = {("db", "create"), ("db", "upgrade"), ("doctor", None), ("purge", None)}


async def _tenant_targets(
    args: argparse.Namespace, outbox: Outbox
) -> list[tuple[str, Outbox]] | None:
    """The tenants' outboxes a command works on (``--tenant``), or None: the outbox itself
    (a single-tenant one; ``dispatch``, which relays every tenant; the consumer commands,
    whose groups and dead letters all tenants share)."""
    tenant: str | None = getattr(args, "tenant", None)
    if outbox.tenants is None:
        if tenant is not None:
            raise CliError(f"--tenant {tenant}: the --app's outbox serves no tenants")
        return None
    command = (args.command, getattr(args, "db_command", None))
    if args.command in ("dispatch", "consumers"):
        if tenant is not None and args.command == "dispatch":
            raise CliError("dispatch relays every tenant of the outbox: no --tenant")
        return None
    try:
        names = await outbox.load_tenants()
    except exceptions.OutboxError as exc:
        raise CliError(f"reading the tenants failed: {redact(str(exc))}") from exc
    if tenant is None:
        raise CliError(
            f"the --app's outbox serves {len(names)} tenant(s): name one with --tenant ID"
            + (" (or --tenant all)" if command in ALL_TENANTS_COMMANDS else "")
        )
    if tenant == "all":
        if command not in ALL_TENANTS_COMMANDS:
            raise CliError("--tenant all: only for db create, db upgrade, doctor and purge")
        return [(name, outbox.tenant_outbox(name)) for name in names]
    try:
        return [(tenant, outbox.tenant_outbox(tenant))]
    except exceptions.UnknownTenant as exc:
        raise CliError(str(exc)) from exc


async def _command(args: argparse.Namespace, outbox: Outbox) -> int:
    """One command on one outbox (a tenant's, with ``--tenant``)."""
    from fastapi_outbox.cli import admin

    if args.command == "db":
        if args.db_command == "sql":
            from fastapi_outbox.storage.schema import ddl

            print(ddl(outbox.table, outbox.engine.dialect), end="")
            for side in side_tables(outbox):  # inbox, leases, archive, payloads
                print("\n" + ddl(side.table, outbox.engine.dialect), end="")
            return EXIT_OK
        if args.db_command == "upgrade":
            return await _upgrade(outbox)
        if args.db_command == "drop-slot":
            return await _drop_slot(outbox, force=args.force)
        await _guard(outbox.create_tables(groups=False), outbox)
        try:
            await outbox.lifecycle.declare_groups()
        except exceptions.BrokerUnavailable as exc:
            error = broker_error(exc, "tables created, but the consumer groups were not: ")
            raise CliError(
                f"{error}; run `fastapi-outbox db create` again once the broker answers",
                error.code,
            ) from exc
        print(
            f"created table {outbox.table.name} and inbox table {outbox.inbox.table.name} "
            f"on {redact_url(str(outbox.engine.url))}"
        )
        if outbox.archive is not None:
            print(f"archive table {outbox.archive.name} ready")
        if outbox.wal_slot is not None:
            print(f"replication slot and publication {outbox.wal_slot.name} ready")
        for sub in outbox.subscribers:
            print(
                f"consumer group {sub.group!r} of stream {sub.stream!r} ready on broker "
                f"{sub.broker_name!r}"
            )
        return EXIT_OK
    if args.command == "dispatch":
        return await dispatch(outbox, http=args.http)
    if args.command == "doctor":
        return await _doctor(outbox)
    return await admin.run(args, outbox)


async def _doctor(outbox: Outbox) -> int:
    """Print each difference between the live tables (the outbox table and the side tables
    its settings and subscribers use) and the expected layout, with its fix."""
    from fastapi_outbox.storage import doctor

    sides = side_tables(outbox)
    findings = await _guard(doctor.examine(outbox.engine, outbox.table, side_tables=sides), outbox)
    where = redact_url(str(outbox.engine.url))
    mismatches = [f for f in findings if f.mismatch]
    for finding in findings:
        print(f"{'MISMATCH' if finding.mismatch else 'advice'}: {finding.what}")
        for statement in finding.fix:
            print(f"  fix: {statement};" if not statement.startswith("--") else f"  {statement}")
        if finding.automatic:
            print("  (or run: fastapi-outbox db upgrade)")
    if mismatches:
        print(f"table {outbox.table.name} on {where}: {len(mismatches)} mismatch(es)")
        return EXIT_FAILED
    print(f"table {outbox.table.name} on {where}: matches the expected layout")
    return EXIT_OK


async def _upgrade(outbox: Outbox) -> int:
    from fastapi_outbox.storage import doctor

    try:
        applied, left = await _guard(
            doctor.upgrade(outbox.engine, outbox.table, side_tables=side_tables(outbox)), outbox
        )
    except doctor.UpgradeLockTimeout as exc:
        raise CliError(str(exc), EXIT_FAILED) from exc
    for finding in applied:
        print(f"fixed: {finding.what}")
    for finding in left:
        print(f"left for you: {finding.what}")
        for statement in finding.fix:
            print(f"  {statement}")
    where = redact_url(str(outbox.engine.url))
    if left:
        print(f"table {outbox.table.name} on {where}: {len(left)} change(s) need you")
        return EXIT_FAILED
    verb = f"upgraded ({len(applied)} change(s))" if applied else "already up to date"
    print(f"table {outbox.table.name} on {where}: {verb}")
    return EXIT_OK


async def _drop_slot(outbox: Outbox, *, force: bool) -> int:
    """``db drop-slot``: after switching back to capture='table' (docs/how-to/wal-capture.md,
    switching modes)."""
    from fastapi_outbox.storage.wal_slot import WalSlot

    slot = outbox.wal_slot or WalSlot(
        outbox.engine, outbox.settings.slot_name, outbox.settings.table_name
    )
    if not outbox.store.is_postgres:
        raise CliError("capture='wal' replication slots exist on PostgreSQL only")
    stats = await _guard(slot.stats(), outbox)
    if stats is None:
        print(f"no replication slot {slot.name}")
        await _guard(slot.drop(), outbox)  # a publication left behind
        return EXIT_OK
    if not force and not stats.lost:
        try:
            count, _ = await _guard(slot.backlog(), outbox)
        except Exception as exc:
            if _sqlstate(exc) == "55006" or getattr(exc, "sqlstate", None) == "55006":
                raise CliError(
                    f"replication slot {slot.name} is being read by a WAL relay: stop the "
                    "relays (or restart them with capture='table') first",
                    EXIT_FAILED,
                ) from exc
            raise
        if count:
            raise CliError(
                f"replication slot {slot.name} still holds {count} unrelayed message(s): "
                "let a relay process with capture='wal' relay them first, or pass --force to "
                "drop them",
                EXIT_FAILED,
            )
    try:
        await _guard(slot.drop(), outbox)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == "55006":
            raise CliError(
                f"replication slot {slot.name} is in use by a WAL relay: stop the relays first",
                EXIT_FAILED,
            ) from exc
        raise
    print(f"dropped replication slot and publication {slot.name}")
    return EXIT_OK


def _print_ddl(args: argparse.Namespace) -> int:
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    from fastapi_outbox.storage.claim_check import build_payload_table
    from fastapi_outbox.storage.group_members import build_group_tables
    from fastapi_outbox.storage.inbox import build_inbox_table
    from fastapi_outbox.storage.leases import build_lease_tables
    from fastapi_outbox.storage.schema import build_archive_table, build_table, ddl

    try:
        settings = OutboxSettings.from_env()
        if settings.partitioning is not None and args.dialect in ("sqlite", "mysql"):
            raise CliError(
                f"partitioning={settings.partitioning!r} (OUTBOX_PARTITIONING) needs "
                f"PostgreSQL: {args.dialect} keeps one plain table"
            )
        table = build_table(
            args.table or settings.table_name,
            ordered=settings.ordered,
            partitioning=settings.partitioning,
        )
        inbox = build_inbox_table(settings.inbox_table_name)
        archive = build_archive_table(table, settings.archive_name) if settings.archive else None
        payloads = (
            build_payload_table(f"{table.name}_payloads")
            if settings.claim_check_bytes is not None and settings.claim_check_store == "database"
            else None
        )
    except exceptions.ConfigurationError as exc:  # bad --table or OUTBOX_* variable
        raise CliError(str(exc)) from exc
    module = {"sqlite": sqlite, "mysql": mysql}.get(args.dialect, postgresql)
    dialect = module.dialect()
    print(ddl(table, dialect), end="")
    print("\n" + ddl(inbox, dialect), end="")
    for lease_table in build_lease_tables(inbox.name, inbox.metadata):
        print("\n" + ddl(lease_table, dialect), end="")
    for group_table in build_group_tables(inbox.name, inbox.metadata):
        print("\n" + ddl(group_table, dialect), end="")
    for side in (archive, payloads):
        if side is not None:
            print("\n" + ddl(side, dialect), end="")
    return EXIT_OK


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(
            f"--http takes HOST:PORT, e.g. 127.0.0.1:9100, not {text!r}"
        )
    return host or "127.0.0.1", int(port)


def _probe_app(outbox: Outbox) -> FastAPI:
    """The HTTP surface of a relay-only process: health, and metrics when the outbox
    reports to Prometheus."""
    from fastapi import FastAPI

    app = FastAPI(title="fastapi-outbox relay", openapi_url=None)
    app.include_router(outbox.health_router)
    try:
        from fastapi_outbox.ops.metrics import PrometheusInstrumentation, mount_metrics
    except ImportError:  # the prometheus extra is not installed
        return app
    if isinstance(outbox.instrumentation, PrometheusInstrumentation):
        mount_metrics(app, outbox)
    return app


async def _serve_probes(outbox: Outbox, host: str, port: int, stop: asyncio.Event) -> None:
    try:
        import uvicorn
    except ImportError as exc:
        raise CliError("--http needs uvicorn: pip install 'fastapi-outbox[examples]'") from exc
    config = uvicorn.Config(
        _probe_app(outbox), host=host, port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    # Signals belong to the relay process: it stops the server when it stops.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    serving = asyncio.ensure_future(server.serve())
    logger.info("serving health", extra={"action": "dispatch.http", "address": f"{host}:{port}"})
    try:
        await stop.wait()
    finally:
        server.should_exit = True
        await serving


async def dispatch(outbox: Outbox, *, http: tuple[str, int] | None = None) -> int:
    """Run the relays until SIGTERM/SIGINT, then shut down cleanly (exit 0)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not outbox.brokers:
        raise CliError(NO_BROKER)
    logger.info(
        "dispatching",
        extra={
            "action": "dispatch.start",
            "database": redact_url(str(outbox.engine.url)),
            "brokers": list(outbox.all_brokers),
        },
    )
    async with outbox.relaying():
        if http is not None:
            await _serve_probes(outbox, *http, stop)
        else:
            await stop.wait()
        logger.info("signal received, shutting down", extra={"action": "dispatch.stop"})
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
