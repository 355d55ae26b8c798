"""Admin commands of the CLI: ``status``, ``list``, ``show``, ``replay``, ``abandon``,
``purge``, ``archive list``/``archive show`` — thin wrappers over
`fastapi_outbox.ops.operations`, which the dashboard calls too.

Long operations (``purge``, ``replay --abandoned``) run in bounded batches and report
``done/total (pct%)`` on stderr: on a terminal by default, on demand with ``--progress``
(one line per step then, for logs), never with ``--no-progress``.

Destructive operations ask first, since a typo must not lose messages: ``purge`` of
abandoned rows, ``replay --abandoned`` and ``cancel`` of more than one id print the count
and the redacted target, then need ``--yes`` (or a ``y`` typed on a terminal); they never
do more than the count they showed. ``--dry-run`` (on ``replay``, ``abandon``, ``cancel``
and ``purge``) prints the count and what would happen and changes nothing. Id lists
(arguments or ``--ids-from FILE``) are processed a page at a time, at most
`MAX_IDS` per command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import TextIO

from fastapi_outbox import exceptions
from fastapi_outbox.cli.support import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    confirm,
    destructive_options,
    operator_name,
    render_table,
    target,
)
from fastapi_outbox.cli.support import guard as _guard
from fastapi_outbox.events import MessageStatus
from fastapi_outbox.ops import operations
from fastapi_outbox.outbox import Outbox

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


def parse_since(text: str) -> dt.datetime:
    """An ISO time (``2026-11-20``, ``2026-11-20T10:00:00+00:00``; UTC when it names no
    zone) or an age (``7d``: seven days ago)."""
    try:
        return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=parse_duration(text))
    except argparse.ArgumentTypeError:
        pass
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid time {text!r}: use an ISO time (2026-11-20T10:00:00) or an age (7d)"
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
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
    _id_arguments(replay)
    destructive_options(replay)
    replay.add_argument("--abandoned", action="store_true", help="every abandoned message")
    replay.add_argument("--stream", help="with --abandoned: only this stream")
    from fastapi_outbox.cli import consumers as consumers_cli

    consumers_cli.add_replay_arguments(replay)

    abandon = sub.add_parser(
        "abandon", help="stop retrying pending or failed messages (not held by a relay)"
    )
    common(abandon)
    _id_arguments(abandon)
    destructive_options(abandon)
    abandon.add_argument("--reason", help="recorded in last_error")

    cancel = sub.add_parser(
        "cancel", help="cancel pending (delayed) messages no relay has claimed yet"
    )
    common(cancel)
    _id_arguments(cancel)
    destructive_options(cancel)

    archive = sub.add_parser(
        "archive", help="messages retention moved to the archive table (archive=True)"
    )
    archive_sub = archive.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    archived = archive_sub.add_parser("list", help="archived messages, newest first (no payloads)")
    common(archived)
    archived.add_argument("--status", choices=["published", "abandoned"])
    archived.add_argument("--stream")
    archived.add_argument("--broker")
    archived.add_argument("--type", dest="type_")
    archived.add_argument("--key")
    archived.add_argument(
        "--since", type=parse_since, metavar="TIME", help="created at or after (ISO time or AGE)"
    )
    archived.add_argument("--limit", type=int, default=50)
    archived.add_argument("--json", action="store_true")
    archived_show = archive_sub.add_parser("show", help="one archived message with its payload")
    common(archived_show)
    archived_show.add_argument("id", type=parse_uuid)

    purge = sub.add_parser("purge", help="delete finished messages in batches")
    common(purge)
    progress(purge)
    purge.add_argument("--published-older-than", type=parse_duration, metavar="AGE")
    purge.add_argument("--abandoned-older-than", type=parse_duration, metavar="AGE")
    purge.add_argument("--batch-size", type=int, default=5000)
    destructive_options(purge)


def _id_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="*", type=parse_uuid, metavar="ID")
    parser.add_argument(
        "--ids-from",
        metavar="FILE",
        help="also the message ids in FILE, one per line ('-': stdin)",
    )


def read_ids(args: argparse.Namespace) -> list[uuid.UUID]:
    """The ids of the arguments and of ``--ids-from``, once each; at most MAX_IDS."""
    ids = list(args.ids)
    source = getattr(args, "ids_from", None)
    if source == "-":
        ids += _parse_ids(sys.stdin, "stdin")
    elif source:
        try:
            with open(source, encoding="utf-8") as lines:
                ids += _parse_ids(lines, source)
        except OSError as exc:
            raise CliError(f"--ids-from {source}: {exc.strerror}") from exc
    try:
        return operations.checked_ids(ids)
    except exceptions.OperationError as exc:
        raise CliError(str(exc)) from exc


def _parse_ids(lines: Iterable[str], source: str) -> list[uuid.UUID]:
    """One id per line; blank lines and ``#`` comments skipped."""
    ids = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            ids.append(uuid.UUID(text))
        except ValueError:
            raise CliError(
                f"--ids-from {source}, line {number}: {text[:60]!r} is not a message id"
            ) from None
    return ids


#: Refusals printed one by one; the rest are counted.
PROBLEMS_SHOWN = 20


def _problems(problems: list[str]) -> str:
    shown = "; ".join(problems[:PROBLEMS_SHOWN])
    more = len(problems) - PROBLEMS_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


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


async def run(args: argparse.Namespace, outbox: Outbox) -> int:
    """Run the operator command ``args.command`` on ``outbox``; the exit code."""
    if args.command == "consumers":
        from fastapi_outbox.cli import consumers as consumers_cli

        return await consumers_cli.run(args, outbox)
    command = _COMMANDS.get(args.command)
    if command is None:
        raise CliError(f"unknown command {args.command!r}")
    return await command(args, outbox)


#: ``status`` columns, in this order.
STATUS_COLUMNS = [
    "broker",
    "pending",
    "processing",
    "failed",
    "abandoned",
    "published",
    "scheduled",
    "oldest_pending_age_seconds",
    "published_last_minute",
]
#: ``list`` columns, in this order.
LIST_COLUMNS = [
    "id",
    "broker",
    "stream",
    "type",
    "key",
    "status",
    "attempts",
    "created_at",
    "last_error",
]


async def _status(args: argparse.Namespace, outbox: Outbox) -> int:
    """``status``: counts by status and broker (and the replication slot of capture="wal")."""
    stats = await _guard(
        outbox.store.messages.stats(
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
        print(render_table(rows, STATUS_COLUMNS))
        if slot is not None:
            print("\nreplication slot (capture='wal'):")
            print("  " + ", ".join(f"{k}={v}" for k, v in slot.items()))
    return EXIT_OK


async def _list(args: argparse.Namespace, outbox: Outbox) -> int:
    """``list``: a page of messages, newest first, without payloads."""
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
        print(render_table([dict(r) for r in rows], LIST_COLUMNS))
    return EXIT_OK


async def _show(args: argparse.Namespace, outbox: Outbox) -> int:
    """``show``: one message with its headers and payload."""
    try:
        data = await _guard(operations.show(outbox, args.id), outbox)
    except exceptions.MessageNotFound as exc:
        raise CliError(str(exc), EXIT_FAILED) from exc
    print(json.dumps(data, indent=2, default=str))
    return EXIT_OK


#: ``archive list`` columns, in this order.
ARCHIVE_COLUMNS = ["id", "broker", "stream", "type", "key", "status", "created_at", "archived_at"]


async def _archive(args: argparse.Namespace, outbox: Outbox) -> int:
    """``archive list`` and ``archive show``: the archive table of ``archive=True``."""
    if outbox.archive is None:
        raise CliError(
            f"{target(outbox)} has no archive: set archive=True (OUTBOX_ARCHIVE=1, or "
            "OutboxSettings(archive=True) in the --app's Outbox)"
        )
    if args.archive_command == "show":
        try:
            data = await _guard(operations.show(outbox, args.id, archived=True), outbox)
        except exceptions.MessageNotFound as exc:
            raise CliError(str(exc), EXIT_FAILED) from exc
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK
    if args.limit < 1:
        raise CliError("--limit must be at least 1")
    try:
        where = operations.MessageFilter(
            status=args.status,
            stream=args.stream,
            broker=args.broker,
            type=args.type_,
            key=args.key,
            since=args.since,
        )
        rows = await _guard(operations.list_archived(outbox, where, limit=args.limit), outbox)
    except exceptions.OperationError as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        print(json.dumps([dict(r) for r in rows], indent=2, default=str))
    else:
        print(render_table([dict(r) for r in rows], ARCHIVE_COLUMNS))
    return EXIT_OK


async def _replay(args: argparse.Namespace, outbox: Outbox) -> int:
    if getattr(args, "dead_letter", None):
        from fastapi_outbox.cli import consumers as consumers_cli

        return await consumers_cli.replay(args, outbox)
    ids = read_ids(args)
    if not ids and not args.abandoned:
        raise CliError("replay needs message ids (or --ids-from FILE) or --abandoned")
    if ids and args.abandoned:
        raise CliError("give message ids or --abandoned, not both")
    if args.stream and not args.abandoned:
        raise CliError("--stream goes with --abandoned")
    if ids:
        outcome = await _guard(
            operations.replay(outbox, ids, operator=operator_name(), dry_run=args.dry_run),
            outbox,
        )
        return _report(outcome, "replay", "replayed", len(ids), outbox, args.dry_run)
    abandoned = outbox.store.messages.count_matching(
        MessageStatus.ABANDONED.value, stream=args.stream
    )
    total = await _guard(abandoned, outbox)
    where = f" on stream {args.stream}" if args.stream else ""
    if total == 0:
        print(f"no abandoned message{where} in {target(outbox)}: nothing to replay")
        return EXIT_OK
    plan = (
        f"replay --abandoned: {total} abandoned message(s){where} in {target(outbox)} go "
        "back to pending and are published again"
    )
    if not confirm(plan, yes=args.yes, dry_run=args.dry_run):
        return EXIT_OK
    progress = Progress(f"replayed abandoned{where}", total, enabled=args.progress)
    replayed = await _guard(
        operations.replay_abandoned(
            outbox,
            stream=args.stream,
            operator=operator_name(),
            progress=progress.advance,
            max_rows=total,  # never more than the count confirmed
        ),
        outbox,
    )
    progress.finish()
    print(f"replayed {replayed} message(s)")
    return EXIT_OK


def _report(
    outcome: operations.Outcome, verb: str, done: str, asked: int, outbox: Outbox, dry_run: bool
) -> int:
    if dry_run:
        print(f"{verb}: {outcome.count} of {asked} message(s) would be {done} in {target(outbox)}")
        if outcome.problems:
            print(f"left alone: {_problems(outcome.problems)}")
        print("dry run: nothing changed")
        return EXIT_OK
    print(f"{done} {outcome.count} message(s)")
    if outcome.problems:
        raise CliError(_problems(outcome.problems), EXIT_FAILED)
    return EXIT_OK


async def _abandon(args: argparse.Namespace, outbox: Outbox) -> int:
    ids = read_ids(args)
    if not ids:
        raise CliError("abandon needs message ids (or --ids-from FILE)")
    outcome = await _guard(
        operations.abandon(
            outbox, ids, operator=operator_name(), reason=args.reason, dry_run=args.dry_run
        ),
        outbox,
    )
    return _report(outcome, "abandon", "abandoned", len(ids), outbox, args.dry_run)


async def _cancel(args: argparse.Namespace, outbox: Outbox) -> int:
    ids = read_ids(args)
    if not ids:
        raise CliError("cancel needs message ids (or --ids-from FILE)")
    if len(ids) > 1 and not args.dry_run:  # a bulk cancel deletes rows: ask first
        preview = await _guard(operations.cancel(outbox, ids, dry_run=True), outbox)
        plan = (
            f"cancel: {preview.count} of {len(ids)} message(s) are pending and would be "
            f"deleted from {target(outbox)} (never published)"
        )
        confirm(plan, yes=args.yes, dry_run=False)
    outcome = await _guard(
        operations.cancel(outbox, ids, operator=operator_name(), dry_run=args.dry_run), outbox
    )
    return _report(outcome, "cancel", "cancelled", len(ids), outbox, args.dry_run)


async def _purge(args: argparse.Namespace, outbox: Outbox) -> int:
    from fastapi_outbox.storage.store import ABANDONED, PUBLISHED

    if args.published_older_than is None and args.abandoned_older_than is None:
        raise CliError("purge needs --published-older-than and/or --abandoned-older-than")
    if args.batch_size < 1:
        raise CliError("--batch-size must be at least 1")
    counts: dict[str, tuple[float, int]] = {}
    for status, age in (
        (PUBLISHED, args.published_older_than),
        (ABANDONED, args.abandoned_older_than),
    ):
        if age is not None:
            total = await _guard(
                outbox.store.messages.count_matching(status, finished_before_seconds=age), outbox
            )
            counts[status] = (age, total)
    plan = "purge: " + ", ".join(
        f"{total} {status} message(s) finished more than {_duration(age)} ago"
        for status, (age, total) in counts.items()
    )
    plan += f" would be deleted from {target(outbox)}"
    abandoned = counts.get(ABANDONED, (0.0, 0))[1]
    if abandoned:  # never delivered: deleting them loses messages, so ask first
        plan += f" ({abandoned} abandoned: never delivered, gone for good)"
        if not confirm(plan, yes=args.yes, dry_run=args.dry_run):
            return EXIT_OK
    elif args.dry_run:
        confirm(plan, yes=False, dry_run=True)
        return EXIT_OK
    deleted: dict[str, int] = {}
    for status, (age, total) in counts.items():
        progress = Progress(f"purged {status}", total, enabled=args.progress)
        deleted[status] = await _guard(
            operations.purge(
                outbox,
                status,
                age,
                batch_size=args.batch_size,
                operator=operator_name(),
                progress=progress.advance,
                max_rows=total,  # never more than the count shown
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


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


_COMMANDS: dict[str, Callable[[argparse.Namespace, Outbox], Awaitable[int]]] = {
    "status": _status,
    "list": _list,
    "show": _show,
    "replay": _replay,
    "abandon": _abandon,
    "cancel": _cancel,
    "purge": _purge,
    "archive": _archive,
}
