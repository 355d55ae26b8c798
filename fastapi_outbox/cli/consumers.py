"""CLI commands of the consumers: ``consumers`` (each subscriber's group with its lag,
pending, dead letters, inbox count and last handled; ``--dead-letters`` lists them) and
``replay --dead-letter STREAM --group G [--entry ID…]``. They need ``--app module:outbox``:
the subscribers are declared in the consuming service's code. Thin wrappers over
`fastapi_outbox.ops.operations`, which the dashboard and health call too."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import DeadLetter
from fastapi_outbox.cli.support import (
    EXIT_AUTHENTICATION,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    CliError,
    broker_error,
    guard,
    operator_name,
    render_table,
)
from fastapi_outbox.consume.subscriber import ConsumerStatus
from fastapi_outbox.log import safe_error
from fastapi_outbox.ops import operations
from fastapi_outbox.outbox import Outbox
from fastapi_outbox.redaction import redact


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], None],
) -> None:
    consumers = sub.add_parser(
        "consumers", help="subscribers' consumer groups: lag, pending, dead letters (needs --app)"
    )
    common(consumers)
    consumers.add_argument("--json", action="store_true", help="machine-readable output")
    consumers.add_argument(
        "--dead-letters", action="store_true", help="also list each group's dead letters"
    )


def add_replay_arguments(replay: argparse.ArgumentParser) -> None:
    replay.add_argument(
        "--dead-letter",
        metavar="STREAM",
        help="re-drive dead letters of the subscriber of STREAM (with --group; needs --app)",
    )
    replay.add_argument("--group", help="with --dead-letter: the consumer group")
    replay.add_argument(
        "--entry",
        action="append",
        metavar="ENTRY_ID",
        help="with --dead-letter: only this dead-letter entry (repeatable; default: all)",
    )
    replay.add_argument(
        "--force",
        action="store_true",
        help="with --dead-letter: replay dead letters older than inbox_retention_seconds "
        "too (other groups, whose inbox rows are gone, handle them again)",
    )


def _need_app(args: argparse.Namespace, what: str) -> None:
    if not getattr(args, "app", None):
        raise CliError(
            f"{what} needs --app module:outbox: the subscribers are declared in the "
            "consuming service's code"
        )


async def run(args: argparse.Namespace, outbox: Outbox) -> int:
    """``consumers``: each subscriber's group (and, with ``--dead-letters``, its dead
    letters)."""
    _need_app(args, "consumers")
    statuses = await guard(operations.consumers(outbox, counts=True), outbox)
    dead: dict[tuple[str, str], list[DeadLetter]] = {}
    if args.dead_letters:
        for c in statuses:
            if c.causes:  # its broker did not answer: said below, with the cause
                continue
            try:
                letters = await operations.dead_letters(outbox, c.stream, c.group)
            except Exception as exc:
                c.causes.append(exc)
                continue
            dead[(c.stream, c.group)] = letters
    code = _print_consumers(args, statuses, dead)
    # What could not be read is an error, with its cause, after what could be read.
    errors = [await _cause_error(c, cause, outbox) for c in statuses for cause in c.causes]
    if not errors:
        return code
    # The exit code of the cause an operator must fix first: credentials, then reach.
    errors.sort(key=lambda e: _FIRST.index(e.code) if e.code in _FIRST else len(_FIRST))
    for error in errors[1:]:
        print(f"fastapi-outbox: error: {redact(str(error))}", file=sys.stderr)
    raise errors[0]


_FIRST = (EXIT_AUTHENTICATION, EXIT_UNREACHABLE)


async def _cause_error(c: ConsumerStatus, cause: BaseException, outbox: Outbox) -> CliError:
    """The CliError that ``cause`` (why ``c``'s figures are unknown) means: a broker that
    refused the credentials (exit code 4) or cannot be reached (3), a database error as
    `guard` judges it, anything else a failure (1)."""
    where = f"consumer group {c.group!r} on {c.stream!r}: "
    if isinstance(cause, exceptions.BrokerUnavailable):
        return broker_error(cause, f"{where}broker {c.broker!r}: ")
    if isinstance(cause, TimeoutError):
        return CliError(
            f"{where}no answer within {operations.CONSUMER_QUERY_TIMEOUT_SECONDS:g}s "
            f"(broker {c.broker!r} or the database)",
            EXIT_UNREACHABLE,
        )

    async def fail() -> None:
        raise cause

    try:
        await guard(fail(), outbox)
    except CliError as exc:
        return CliError(f"{where}{exc}", exc.code)
    except Exception:
        pass
    return CliError(f"{where}{safe_error(cause)}", EXIT_FAILED)


def _print_consumers(
    args: argparse.Namespace,
    statuses: list[ConsumerStatus],
    dead: dict[tuple[str, str], list[DeadLetter]],
) -> int:
    if args.json:
        rows = [c.model_dump(mode="json") for c in statuses]
        if args.dead_letters:
            for row in rows:
                row["dead_letter_entries"] = [
                    dataclasses.asdict(d) for d in dead[(row["stream"], row["group"])]
                ]
        print(json.dumps(rows, indent=2, default=str))
        return EXIT_OK
    columns = [
        "stream",
        "group",
        "broker",
        "running",
        "lag",
        "pending",
        "dead_letters",
        "handled",
        "last_handled_at",
    ]
    rows = [c.model_dump() for c in statuses]
    if any(c.lag_partitions for c in statuses):  # Kafka: the lag of each partition
        columns.insert(columns.index("lag") + 1, "lag_partitions")
        for row in rows:
            parts = row["lag_partitions"] or {}
            row["lag_partitions"] = " ".join(f"{p}:{n}" for p, n in sorted(parts.items()))
    print(render_table(rows, columns))
    for (stream, group), letters in dead.items():
        print(f"\ndead letters of {group} on {stream}:")
        print(
            render_table(
                [dataclasses.asdict(d) for d in letters],
                ["entry_id", "message_id", "type", "attempts", "dead_lettered_at", "error"],
            )
        )
    return EXIT_OK


async def _dry_run(args: argparse.Namespace, outbox: Outbox) -> int:
    """``replay --dead-letter … --dry-run``: how many would go back, how many are stale."""
    letters = await operations.dead_letters(
        outbox, args.dead_letter, args.group, limit=operations.STALE_SCAN
    )
    if args.entry:
        letters = [d for d in letters if d.entry_id in set(args.entry)]
    stale = await operations.stale_dead_letters(outbox, args.dead_letter, args.group, args.entry)
    print(
        f"replay --dead-letter: {len(letters)} dead letter(s) of {args.group} would go back "
        f"onto {args.dead_letter}; {len(stale)} older than inbox_retention_seconds "
        "(other groups would handle those again: they need --force)"
    )
    print("dry run: nothing changed")
    return EXIT_OK


async def replay(args: argparse.Namespace, outbox: Outbox) -> int:
    """``replay --dead-letter STREAM --group G [--entry ID…]``."""
    _need_app(args, "replay --dead-letter")
    if not args.group:
        raise CliError("replay --dead-letter STREAM needs --group GROUP")
    if args.ids or args.abandoned or getattr(args, "ids_from", None):
        raise CliError(
            "replay --dead-letter takes --entry ENTRY_ID, not message ids or --abandoned"
        )
    try:
        if args.dry_run:
            return await _dry_run(args, outbox)
        count = await guard(
            operations.replay_dead_letters(
                outbox,
                args.dead_letter,
                args.group,
                args.entry,
                operator=operator_name(),
                force=args.force,
            ),
            outbox,
        )
    except exceptions.StaleDeadLetters as exc:
        raise CliError(f"not replayed: {exc}") from exc
    except exceptions.OperationError as exc:
        raise CliError(str(exc)) from exc
    except exceptions.BrokerUnavailable as exc:
        raise broker_error(exc) from exc
    print(f"replayed {count} dead letter(s) of {args.group} onto {args.dead_letter}")
    if args.entry and count < len(set(args.entry)):
        raise CliError(
            f"{len(set(args.entry)) - count} of the given entries are not dead letters of "
            f"{args.group} on {args.dead_letter}",
            EXIT_FAILED,
        )
    return EXIT_OK
