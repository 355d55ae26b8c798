"""The ``fastapi-outbox`` command (also ``python -m fastapi_outbox``).

The database comes from ``--url``, from ``--app module:outbox`` (an :class:`Outbox` in an
importable module) or from ``OUTBOX_DATABASE_URL``. Exit codes: 0 success, 1 failure of
the operation, 2 usage or configuration error, 3 database unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import redact_url

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

logger = logging.getLogger("fastapi_outbox.cli")


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def load_outbox(spec: str) -> Any:
    """Import ``module:attribute`` and return the Outbox it names."""
    from fastapi_outbox.outbox import Outbox

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


def resolve_outbox(args: argparse.Namespace) -> Any:
    """The Outbox the command works on: ``--app``, else ``--url``/``OUTBOX_DATABASE_URL``."""
    from fastapi_outbox.outbox import Outbox
    from fastapi_outbox.settings import OutboxSettings

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
    try:
        return Outbox(url, settings=settings)
    except exceptions.OutboxError as exc:
        raise CliError(str(exc)) from exc


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="database URL (else OUTBOX_DATABASE_URL)")
    parser.add_argument("--app", help="module:attribute naming an Outbox")
    parser.add_argument("--table", help="outbox table name (default from settings)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastapi-outbox", description="Operate a fastapi-outbox transactional outbox."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    db = sub.add_parser("db", help="create the outbox table or print its DDL")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    create = db_sub.add_parser("create", help="create the outbox table and indexes")
    _common(create)
    sql = db_sub.add_parser("sql", help="print the DDL")
    _common(sql)
    sql.add_argument(
        "--dialect", choices=["postgresql", "sqlite"], help="dialect when no --url is given"
    )

    dispatch = sub.add_parser("dispatch", help="run the dispatchers without a web server")
    _common(dispatch)

    from fastapi_outbox import admin

    admin.add_commands(sub, _common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s%(extras)s",
        stream=sys.stderr,
    )
    _install_extras_formatter()
    try:
        return asyncio.run(_run(args))
    except CliError as exc:
        print(f"fastapi-outbox: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


async def _run(args: argparse.Namespace) -> int:
    from fastapi_outbox import admin

    if args.command == "db" and args.db_command == "sql" and not args.url and not args.app:
        return _print_ddl(args)
    outbox = resolve_outbox(args)
    try:
        if args.command == "db":
            if args.db_command == "sql":
                from fastapi_outbox.schema import ddl

                print(ddl(outbox.table, outbox.engine.dialect), end="")
                return EXIT_OK
            await _guard(outbox.create_tables(), outbox)
            print(f"created table {outbox.table.name} on {redact_url(str(outbox.engine.url))}")
            return EXIT_OK
        if args.command == "dispatch":
            return await dispatch(outbox)
        return await admin.run(args, outbox)
    finally:
        await outbox.aclose()


def _print_ddl(args: argparse.Namespace) -> int:
    from sqlalchemy.dialects import postgresql, sqlite

    from fastapi_outbox.schema import build_table, ddl
    from fastapi_outbox.settings import OutboxSettings

    name = args.table or OutboxSettings.from_env().table_name
    module = sqlite if args.dialect == "sqlite" else postgresql
    dialect = module.dialect()
    print(ddl(build_table(name), dialect), end="")
    return EXIT_OK


async def _guard(coro: Any, outbox: Any) -> Any:
    """Await ``coro``; a database that cannot be reached becomes exit code 3."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    try:
        return await coro
    except (OSError, OperationalError, InterfaceError, DBAPIError) as exc:
        if (
            isinstance(exc, DBAPIError)
            and not exc.connection_invalidated
            and not isinstance(exc, OperationalError | InterfaceError)
        ):
            raise
        raise CliError(
            f"database {redact_url(str(outbox.engine.url))} unreachable: {type(exc).__name__}",
            EXIT_UNREACHABLE,
        ) from exc


async def dispatch(outbox: Any) -> int:
    """Run the processors until SIGTERM/SIGINT, then shut down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info(
        "dispatching",
        extra={
            "action": "dispatch.start",
            "database": redact_url(str(outbox.engine.url)),
            "brokers": list(outbox.all_brokers),
        },
    )
    async with outbox.dispatcher():
        await stop.wait()
        logger.info("signal received, shutting down", extra={"action": "dispatch.stop"})
    return EXIT_OK


_STANDARD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
}


class _ExtrasFilter(logging.Filter):
    """Appends ``extra=`` fields (action, ids) to CLI log lines: ``key=value``."""

    def filter(self, record: logging.LogRecord) -> bool:
        extras = {
            k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and k != "extras"
        }
        record.extras = "".join(f" {k}={v}" for k, v in extras.items())
        return True


def _install_extras_formatter() -> None:
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ExtrasFilter())


if __name__ == "__main__":
    raise SystemExit(main())
