"""Which errors of a request's unit of work answer 503 with Retry-After (no I/O: the
verdicts here are certain from the exception, so no ping is made)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from sqlalchemy import exc as sa_exc

from fastapi_outbox import exceptions
from fastapi_outbox.write.unavailable import NOT_SAVED, UNKNOWN_OUTCOME, unavailable

ENGINE = SimpleNamespace(dialect=SimpleNamespace(name="postgresql"))
POOL_TIMEOUT = sa_exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached")


def lost_commit() -> exceptions.UnitOfWorkError:
    """What the unit of work raises for a connection lost once COMMIT was sent."""
    try:
        raise exceptions.CommitOutcomeUnknown("lost during COMMIT") from POOL_TIMEOUT
    except exceptions.CommitOutcomeUnknown as exc:
        return exc


async def test_a_database_outage_is_503_with_retry_after() -> None:
    answer = await unavailable(POOL_TIMEOUT, ENGINE, committing=False)
    assert answer is not None and answer.status_code == 503
    assert answer.detail == NOT_SAVED and answer.headers == {"Retry-After": "5"}


async def test_a_lost_commit_says_the_outcome_is_unknown() -> None:
    answer = await unavailable(lost_commit(), ENGINE, committing=True)
    assert answer is not None and answer.detail == UNKNOWN_OUTCOME
    direct = await unavailable(POOL_TIMEOUT, ENGINE, committing=True)
    assert direct is not None and direct.detail == UNKNOWN_OUTCOME


async def test_a_broker_outage_is_503() -> None:
    answer = await unavailable(exceptions.BrokerRefusing("OOM"), ENGINE, committing=False)
    assert answer is not None and answer.status_code == 503


@pytest.mark.parametrize(
    "error",
    [ValueError("the app's bug"), HTTPException(409, "conflict"), exceptions.UnitOfWorkError("x")],
)
async def test_other_errors_keep_their_answer(error: Exception) -> None:
    assert await unavailable(error, ENGINE, committing=False) is None
