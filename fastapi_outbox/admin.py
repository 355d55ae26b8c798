"""Admin commands of the CLI: ``status``, ``list``, ``show``, ``replay``, ``abandon``,
``purge`` — thin wrappers over :mod:`fastapi_outbox.operations`, which the dashboard
calls too.

Long operations (``purge``, ``replay --abandoned``) run in bounded batches and report
``done/total (pct%)`` on stderr: on a terminal by default, on demand with ``--progress``
(one line per step then, for logs), never with ``--no-progress``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TextIO

from fastapi_outbox import exceptions, operations
from fastapi_outbox.cli_support import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    operator_name,
    render_table,
)
from fastapi_outbox.cli_support import guard as _guard
from fastapi_outbox.events import MessageStatus

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``15m``, ``12h``, ``7d``, ``2w`` → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid message id {text!r}: not a UUID") from None


def add_commands(
    sub: Any,
    common: Callable[[argparse.ArgumentParser], None],
    progress: Callable[[argparse.ArgumentParser], None],
) -> None:
    status = sub.add_parser("status", help="counts by status and broker, oldest pending age")
    common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    ls = sub.add_parser("list", help="list messages, newest first (no payloads)")
    common(ls)
    ls.add_argument("--status", choices=list(operations.STATUS_FILTERS))
    ls.add_argument("--stream")
    ls.add_argument("--broker")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")

    show = sub.add_parser("show", help="one message with its payload and headers")
    common(show)
    show.add_argument("id", type=parse_uuid)

    replay = sub.add_parser(
        "replay", help="move abandoned (or failed) messages back to pending, attempts reset"
    )
    common(replay)
    progress(replay)
    replay.add_argument("ids", nargs="*", type=parse_uuid, metavar="ID")
    replay.add_argument("--abandoned", action="store_true", help="every abandoned message")
    replay.add_argument("--stream", help="with --abandoned: only this stream")
    from fastapi_outbox import consumers_cli

    consumers_cli.add_replay_arguments(replay)

    abandon = sub.add_parser(
        "abandon", help="stop retrying pending or failed messages (not held by a dispatcher)"
    )
    common(abandon)
    abandon.add_argument("ids", nargs="+", type=parse_uuid, metavar="ID")
    abandon.add_argument("--reason", help="recorded in last_error")

    cancel = sub.add_parser(
        "cancel", help="cancel pending (delayed) messages no dispatcher has claimed yet"
    )
    common(cancel)
    cancel.add_argument("ids", nargs="+", type=parse_uuid, metavar="ID")

    purge = sub.add_parser("purge", help="delete finished messages in batches")
    common(purge)
    progress(purge)
    purge.add_argument("--published-older-than", type=parse_duration, metavar="AGE")
    purge.add_argument("--abandoned-older-than", type=parse_duration, metavar="AGE")
    purge.add_argument("--batch-size", type=int, default=5000)


class Progress:
    """``label: done/total (pct%)`` on ``stream``. On a terminal the line is rewritten in
    place; elsewhere (forced with ``--progress``) a new line is written every 10 %."""

    def __init__(
        self, label: str, total: int, *, enabled: bool | None, stream: TextIO | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self.label = label
        self.total = total
        self.done = 0
        self._last_step = -1
        self._last_draw = 0.0
        self._written = ""

    def advance(self, n: int) -> None:
        self.done += n
        self.total = max(self.total, self.done)  # rows that qualified meanwhile
        if not self.enabled:
            return
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._write(f"\r{self._line()}")
        elif self._pct() // 10 != self._last_step:
            self._last_step = self._pct() // 10
            self._write(f"{self._line()}\n")

    def finish(self) -> None:
        """Draw the final count (once more unless it is on screen already)."""
        if not self.enabled:
            return
        if self.tty:
            self._write(f"\r{self._line()}\n")
        elif self._written != self._line():
            self._write(f"{self._line()}\n")

    def _pct(self) -> int:
        return 100 if self.total == 0 else int(self.done * 100 / self.total)

    def _line(self) -> str:
        return f"{self.label}: {self.done}/{self.total} ({self._pct()}%)"

    def _write(self, text: str) -> None:
        self._written = text.strip("\r\n")
        self.stream.write(text)
        self.stream.flush()


async def run(args: argparse.Namespace, outbox: Any) -> int:
    command = args.command
    if command == "status":
        stats = await _guard(
            outbox.store.stats(
                outbox.all_brokers, published_totals=True, ordered=outbox.settings.ordered
            ),
            outbox,
        )
        rows = [dataclasses.asdict(s) for s in stats.values()]
        slot = None
        if outbox.wal_slot is not None:  # capture="wal": the replication slot too
            slot = await _guard(outbox.wal_slot.report(), outbox)
        if args.json and slot is not None:
            print(json.dumps({"brokers": rows, "wal_slot": slot}, indent=2, default=str))
        elif args.json:
            print(json.dumps(rows, indent=2, default=str))
        else:
            print(
                render_table(
                    rows,
                    [
                        "broker",
                        "pending",
                        "processing",
                        "failed",
                        "abandoned",
                        "published",
                        "scheduled",
                        "oldest_pending_age_seconds",
                        "published_last_minute",
                    ],
                )
            )
            if slot is not None:
                print("\nreplication slot (capture='wal'):")
                print("  " + ", ".join(f"{k}={v}" for k, v in slot.items()))
        return EXIT_OK
    if command == "list":
        if args.limit < 1:
            raise CliError("--limit must be at least 1")
        where = operations.MessageFilter(status=args.status, stream=args.stream, broker=args.broker)
        try:
            rows = await _guard(operations.list_messages(outbox, where, limit=args.limit), outbox)
        except exceptions.OperationError as exc:
            raise CliError(str(exc)) from exc
        if args.json:
            print(json.dumps([dict(r) for r in rows], indent=2, default=str))
        else:
            print(
                render_table(
                    [dict(r) for r in rows],
                    [
                        "id",
                        "broker",
                        "stream",
                        "type",
                        "key",
                        "status",
                        "attempts",
                        "created_at",
                        "last_error",
                    ],
                )
            )
        return EXIT_OK
    if command == "show":
        try:
            data = await _guard(operations.show(outbox, args.id), outbox)
        except exceptions.MessageNotFound as exc:
            raise CliError(str(exc), EXIT_FAILED) from exc
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK
    if command == "replay":
        return await _replay(args, outbox)
    if command == "abandon":
        return await _abandon(args, outbox)
    if command == "cancel":
        return await _cancel(args, outbox)
    if command == "purge":
        return await _purge(args, outbox)
    if command == "consumers":
        from fastapi_outbox import consumers_cli

        return await consumers_cli.run(args, outbox)
    raise CliError(f"unknown command {command!r}")


async def _replay(args: argparse.Namespace, outbox: Any) -> int:
    if getattr(args, "dead_letter", None):
        from fastapi_outbox import consumers_cli

        return await consumers_cli.replay(args, outbox)
    if not args.ids and not args.abandoned:
        raise CliError("replay needs message ids or --abandoned")
    if args.ids and args.abandoned:
        raise CliError("give message ids or --abandoned, not both")
    if args.stream and not args.abandoned:
        raise CliError("--stream goes with --abandoned")
    if args.ids:
        outcome = await _guard(
            operations.replay(outbox, args.ids, operator=operator_name()), outbox
        )
        print(f"replayed {outcome.count} message(s)")
        if outcome.problems:
            raise CliError("; ".join(outcome.problems), EXIT_FAILED)
        return EXIT_OK
    total = await _guard(
        outbox.store.count_matching(MessageStatus.ABANDONED.value, stream=args.stream), outbox
    )
    where = f" on stream {args.stream}" if args.stream else ""
    progress = Progress(f"replayed abandoned{where}", total, enabled=args.progress)
    replayed = await _guard(
        operations.replay_abandoned(
            outbox, stream=args.stream, operator=operator_name(), progress=progress.advance
        ),
        outbox,
    )
    progress.finish()
    print(f"replayed {replayed} message(s)")
    return EXIT_OK


async def _abandon(args: argparse.Namespace, outbox: Any) -> int:
    outcome = await _guard(
        operations.abandon(outbox, args.ids, operator=operator_name(), reason=args.reason), outbox
    )
    print(f"abandoned {outcome.count} message(s)")
    if outcome.problems:
        raise CliError("; ".join(outcome.problems), EXIT_FAILED)
    return EXIT_OK


async def _cancel(args: argparse.Namespace, outbox: Any) -> int:
    outcome = await _guard(operations.cancel(outbox, args.ids, operator=operator_name()), outbox)
    print(f"cancelled {outcome.count} message(s)")
    if outcome.problems:
        raise CliError("; ".join(outcome.problems), EXIT_FAILED)
    return EXIT_OK


async def _purge(args: argparse.Namespace, outbox: Any) -> int:
    from fastapi_outbox.store import ABANDONED, PUBLISHED

    if args.published_older_than is None and args.abandoned_older_than is None:
        raise CliError("purge needs --published-older-than and/or --abandoned-older-than")
    if args.batch_size < 1:
        raise CliError("--batch-size must be at least 1")
    deleted: dict[str, int] = {}
    for status, age in (
        (PUBLISHED, args.published_older_than),
        (ABANDONED, args.abandoned_older_than),
    ):
        if age is None:
            continue
        total = await _guard(
            outbox.store.count_matching(status, finished_before_seconds=age), outbox
        )
        progress = Progress(f"purged {status}", total, enabled=args.progress)
        deleted[status] = await _guard(
            operations.purge(
                outbox,
                status,
                age,
                batch_size=args.batch_size,
                operator=operator_name(),
                progress=progress.advance,
            ),
            outbox,
        )
        progress.finish()
    print(
        f"purged {sum(deleted.values())} message(s) ("
        + ", ".join(f"{n} {status}" for status, n in deleted.items())
        + ")"
    )
    return EXIT_OK
