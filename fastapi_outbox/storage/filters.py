"""The one filter of an operator's message listing: built once where the operator's request
is read (the CLI's flags, the dashboard's query string), checked there, and handed down
whole to the statement that lists the outbox table or its archive."""

from __future__ import annotations

import dataclasses
import datetime as dt

from fastapi_outbox import exceptions
from fastapi_outbox.events import MessageStatus

__all__ = ["SCHEDULED", "STATUS_FILTERS", "MessageFilter"]

#: The status filter of pending messages not yet due (delayed ones): not a stored status.
SCHEDULED = "scheduled"
#: ``status`` filters: the stored statuses, and ``scheduled``.
STATUS_FILTERS = (*(s.value for s in MessageStatus), SCHEDULED)


@dataclasses.dataclass(slots=True)
class MessageFilter:
    """Which messages a listing shows; ``None`` means any. ``since``/``until`` bound
    ``created_at`` (a naive time is taken as UTC)."""

    status: str | None = None
    stream: str | None = None
    broker: str | None = None
    type: str | None = None
    key: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUS_FILTERS:
            raise exceptions.OperationError(
                f"status: {self.status!r} is not one of " + ", ".join(STATUS_FILTERS)
            )
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                setattr(self, name, value.replace(tzinfo=dt.UTC))

    def equalities(self) -> dict[str, str | None]:
        """The columns matched by equality, by column name."""
        return {"stream": self.stream, "broker": self.broker, "type": self.type, "key": self.key}
