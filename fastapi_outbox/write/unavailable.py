"""What a request whose unit of work met an outage answers: ``503 Service Unavailable``
with ``Retry-After`` and a short body, instead of a bare 500 or a reset connection.

The request dependency (``Depends(unit_of_work)``) maps an error that means the database is
unavailable (`fastapi_outbox.storage.db_outage.is_outage`: refused, starting or
shutting down, too many clients, no pooled connection within ``pool_timeout``…) or that a
broker is ([`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable]) to that answer. The
outcome is the unit of work's, unchanged: nothing of the request was committed — except when
the database went away during the COMMIT itself, when nobody can know, and the body says so.
Every other error goes on as it was raised (the app's own 500s, its HTTPExceptions).
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from fastapi_outbox import exceptions
from fastapi_outbox.storage.db_outage import is_outage

__all__ = ["RETRY_AFTER_SECONDS", "unavailable"]

#: ``Retry-After`` of a 503 answered during an outage: a client's next try.
RETRY_AFTER_SECONDS = 5

NOT_SAVED = "the database is unavailable: nothing was saved; retry later"
BROKER_DOWN = "a message broker is unavailable: nothing was saved; retry later"
UNKNOWN_OUTCOME = (
    "the database became unavailable while saving: the request may or may not have been "
    "saved; retry only if it is safe to repeat"
)


async def unavailable(exc: Exception, engine: Any, *, committing: bool) -> HTTPException | None:
    """The 503 to answer for ``exc`` (None: not an outage, let it go on). ``engine``: the
    unit of work's, pinged when the error alone cannot tell; ``committing``: the endpoint
    had returned and the error came from the COMMIT."""
    if isinstance(exc, HTTPException):
        return None
    # The unit of work may restate a lost COMMIT as an error of its own, chained to the
    # driver's: the driver's error is what says whether the database went away.
    cause = exc.__cause__ if isinstance(exc, exceptions.UnitOfWorkError) else None
    if isinstance(exc, exceptions.BrokerUnavailable):
        detail = BROKER_DOWN
    elif engine is not None and await is_outage(exc, engine):
        detail = UNKNOWN_OUTCOME if committing else NOT_SAVED
    elif engine is not None and committing and cause is not None and await is_outage(cause, engine):
        detail = UNKNOWN_OUTCOME
    else:
        return None
    return HTTPException(503, detail, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
