"""What the CLI's command modules share (`fastapi_outbox.cli`, `fastapi_outbox.cli.admin`,
`fastapi_outbox.cli.consumers`): exit codes, the usage error, the database guard that
turns an unreachable database or a missing table into an exit code with a clear message,
and the plain-text table of listings.

Exit codes: 0 success, 1 failure of the operation (unknown message id, missing table),
2 usage or configuration error, 3 database or broker unreachable, 4 authentication failed
(the database or a broker refused the URL's credentials: no retry will cure it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Awaitable
from typing import Any, TextIO, TypeVar

from fastapi_outbox import exceptions
from fastapi_outbox.log import safe_error
from fastapi_outbox.outbox import Outbox
from fastapi_outbox.redaction import redact_url
from fastapi_outbox.storage import db_outage

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTHENTICATION = 4


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def sqlstate(exc: BaseException) -> str:
    """The PostgreSQL SQLSTATE ``exc`` carries, or ``""``."""
    return db_outage.sqlstate_of(exc) or ""


async def guard(coro: Awaitable[T], outbox: Outbox) -> T:
    """Await ``coro``; what the dialect's classifier
    (`fastapi_outbox.storage.db_outage`) says of a failure becomes an exit code with a
    message naming the (redacted) URL and the fix: a missing outbox table exit code 1,
    refused credentials 4, a database that cannot be reached 3 (an ambiguous error, an
    ``OSError``, counts as unreachable here: the CLI runs no handler code of its own)."""
    where = redact_url(str(outbox.engine.url))
    try:
        return await coro
    except Exception as exc:
        verdict = db_outage.classify(exc, outbox.engine.dialect.name)
        if verdict is db_outage.Verdict.TABLE_MISSING:
            raise CliError(
                f"table missing on {where} ({safe_error(exc, 120)}): {db_outage.TABLE_MISSING_FIX}",
                EXIT_FAILED,
            ) from exc
        if verdict is db_outage.Verdict.AUTHENTICATION:
            raise CliError(
                f"database {where}: authentication failed ({safe_error(exc, 200)}): "
                f"{db_outage.AUTHENTICATION_FIX}",
                EXIT_AUTHENTICATION,
            ) from exc
        if verdict is not db_outage.Verdict.FAILURE:
            raise CliError(
                f"database {where} unreachable: {safe_error(exc, 200)}", EXIT_UNREACHABLE
            ) from exc
        raise


def broker_error(exc: exceptions.BrokerUnavailable, prefix: str = "") -> CliError:
    """The CLI's error for a broker outage: exit code 4 when the broker refused the
    credentials ([`AuthenticationFailed`][fastapi_outbox.AuthenticationFailed]), else 3."""
    code = (
        EXIT_AUTHENTICATION
        if isinstance(exc, exceptions.AuthenticationFailed)
        else EXIT_UNREACHABLE
    )
    return CliError(f"{prefix}{exc}", code)


def target(outbox: Outbox) -> str:
    """What a command works on, for its confirmation: the table and the database (its URL
    redacted: the database may come from OUTBOX_DATABASE_URL, and the operator should
    see which one it is)."""
    return f"table {outbox.table.name} on {redact_url(str(outbox.engine.url))}"


def destructive_options(parser: argparse.ArgumentParser) -> None:
    """``--yes`` and ``--dry-run`` of a command that changes or deletes many messages."""
    parser.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="do it without asking (needed when stdin is not a terminal)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the count and what would happen; change nothing",
    )


def confirm(
    plan: str,
    *,
    yes: bool,
    dry_run: bool,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
) -> bool:
    """Print ``plan`` (the count and the redacted target); True when the command may go
    on: ``--yes``, or a ``y`` typed on a terminal. ``--dry-run``: False (nothing changes).
    Without a terminal and without ``--yes``: a usage error saying so, nothing changed."""
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    print(plan, file=out)
    if dry_run:
        print("dry run: nothing changed", file=out)
        return False
    if yes:
        return True
    if not stdin.isatty():
        raise CliError(
            "not confirmed, nothing changed: pass --yes to do it without a terminal "
            "(or --dry-run to see what it would do)"
        )
    out.write("Proceed? [y/N] ")
    out.flush()
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise CliError("not confirmed, nothing changed", EXIT_FAILED)
    return True


def operator_name() -> str:
    """Who runs the CLI, for the operations' log records."""
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return "cli"


def render_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.1f}"
        if isinstance(value, dt.datetime):
            return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        text = " ".join(str(value).split())
        return text if len(text) <= 60 else text[:57] + "..."

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)
