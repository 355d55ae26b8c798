"""A unit of work's COMMIT, its outcome told truly.

Two moments make a commit's outcome easy to misreport:

* the caller is cancelled (a request timeout, a task group shutting down) while the commit
  runs. Cancelled in the middle, SQLAlchemy's commit is left half done: the COMMIT may have
  reached the database (the transaction is saved) while the session still says "commit in
  progress", and the rollback that follows fails with ``InvalidRequestError`` — reported in
  place of the cancellation, for an order that was saved. So the commit runs in a task of
  its own that a cancellation of the caller does not interrupt: the caller waits for the
  outcome (the COMMIT takes a round trip), then its cancellation is raised, and
  ``uow.committed`` says whether the transaction was saved;
* the connection dies after the COMMIT was sent: the database may have committed or not,
  and nothing came back to tell. That is
  [`CommitOutcomeUnknown`][fastapi_outbox.exceptions.CommitOutcomeUnknown], never an ordinary
  failure a caller would simply retry. The outbox
  rows are in that same transaction, so the events are exactly what the database holds.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Any

import anyio
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_outbox import exceptions
from fastapi_outbox.storage import db_outage

__all__ = ["commit", "roll_back"]

logger = logging.getLogger("fastapi_outbox.write")

#: Set inside a commit's own task: a one-element list made True when its COMMIT is sent.
_COMMIT_SENT: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "fastapi_outbox.commit_sent", default=None
)


@sa_event.listens_for(Engine, "commit")
def _note_the_commit_sent(conn: Connection) -> None:
    sent = _COMMIT_SENT.get()
    if sent is not None:
        sent[0] = True


async def _commit(session: AsyncSession, sent: list[bool], committed: Callable[[], None]) -> None:
    _COMMIT_SENT.set(sent)  # in the task's own context
    await session.commit()
    committed()


async def commit(session: AsyncSession, committed: Callable[[], None]) -> None:
    """Commit ``session``'s transaction (module docstring), calling ``committed`` once it
    is: a cancellation of the caller waits for the commit's outcome and is raised after
    it; a connection lost once COMMIT was sent raises
    [`CommitOutcomeUnknown`][fastapi_outbox.exceptions.CommitOutcomeUnknown]."""
    sent = [False]
    task = asyncio.get_running_loop().create_task(_commit(session, sent, committed))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():  # the caller was cancelled, not the commit
            await _outcome_of(task)
        raise
    except Exception as exc:
        told = _told(exc, sent[0], session)
        if told is exc:
            raise
        raise told from exc


async def _outcome_of(task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` to end, whatever cancellations come meanwhile (each is the same
    cancellation of the caller, raised once the outcome is known)."""
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
        except Exception:
            return


def _told(exc: Exception, sent: bool, session: AsyncSession) -> Exception:
    """The error to raise for a commit that failed with ``exc``: itself when the database
    answered (or the COMMIT was never sent), else
    [`CommitOutcomeUnknown`][fastapi_outbox.exceptions.CommitOutcomeUnknown]."""
    if not sent:
        return exc
    bind = session.bind
    dialect = bind.dialect.name if bind is not None else "postgresql"
    answered = (db_outage.Verdict.FAILURE, db_outage.Verdict.CONTENTION)
    if db_outage.classify(exc, dialect) in answered:
        return exc  # the database answered (a deadlock too): not committed
    return exceptions.CommitOutcomeUnknown(
        f"the connection was lost while COMMIT was on its way ({type(exc).__name__}: "
        f"{exc}): the transaction may have committed or not, and the database alone knows. "
        "Look the business rows up before doing the work again (or make it idempotent); "
        "the outbox's events are exactly what the database holds"
    )


async def roll_back(session: AsyncSession) -> None:
    """Roll back a unit of work that failed, keeping the error that ended it: when the
    rollback itself fails (the connection cut, the rollback cancelled), the session's
    connection is invalidated — its state is unknown, and back in the pool it would fail
    the next unit of work handed it — and the rollback's error is only logged (a
    cancellation of the rollback is raised: it is the caller's)."""
    try:
        with anyio.CancelScope(shield=True):
            await session.rollback()
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            try:
                await session.invalidate()
            except Exception:
                logger.debug("invalidating a connection failed", exc_info=True)
        logger.warning(
            "rollback failed; its connection is discarded",
            extra={"action": "unit_of_work.rollback_failed", "error": repr(exc)[:300]},
        )
        if not isinstance(exc, Exception):
            raise
