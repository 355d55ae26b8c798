"""The stage protocol: one transformation of a message's payload and headers, undone on the
consume side. A stage is added to the list `build_payloads`
makes; nothing else changes."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

__all__ = ["Parts", "PayloadStage", "Revealed"]


@dataclasses.dataclass(slots=True)
class Parts:
    """A message's payload and headers as a stage sees them (a stage returns new ``Parts``
    or these, changed). ``message_id``, ``stream`` and ``type`` are read-only context: a
    stage binds its output to them (associated data), never changes them."""

    message_id: str
    stream: str
    type: str
    #: The payload as it is stored and sent: JSON text, UTF-8 encoded.
    payload: bytes
    #: User and stage headers (write side: before the outbox adds message id, type, trace).
    headers: dict[str, str]
    #: Write side: keys a stage adds to the message's first outbox row, which the commit's
    #: write takes off it (claim-check: the payload for its store, written in the
    #: producer's transaction, see `fastapi_outbox.write.claim_check.put_claims`).
    row: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Revealed:
    """What an operator sees of a payload this process cannot (or must not) show: a
    ``note`` such as ``encrypted (key k2)``, and the headers as far as they were opened."""

    note: str
    headers: dict[str, str]


class PayloadStage(Protocol):
    """One transformation of payloads, in `Payloads`' list.

    ``marker``: the header whose presence on a delivery says this stage sealed it (checked
    before anything is parsed: a delivery without any stage's marker costs nothing).
    ``headers``: every header name the stage sets (lower case); users may not set them."""

    marker: str
    headers: frozenset[str]

    @property
    def seals(self) -> bool:
        """Whether `seal` may change anything in this process (False: the write path
        skips the stages entirely when none does)."""
        ...

    def seal(self, parts: Parts, session: Any) -> Parts:
        """Write side (synchronous, inside ``publish``): ``parts`` transformed; ``session``
        is the unit of work's synchronous SQLAlchemy ``Session`` (a stage may add rows to
        the same transaction). Raise a ``PublishError`` to refuse the message."""
        ...

    async def open(self, parts: Parts) -> Parts:
        """Consume side: ``parts`` restored, the marker and the stage's headers removed.
        Raise [`PayloadUnreadable`][fastapi_outbox.testing.PayloadUnreadable] (naming the message
        id)
        when it cannot be: the message is dead-lettered, not retried. Any other exception
        counts as a failed attempt (retried, e.g. a store unreachable)."""
        ...

    async def reveal(self, parts: Parts) -> Parts | Revealed:
        """Ops side: restored ``parts`` when this process can (and may) read them, else
        `Revealed` with a note saying why not."""
        ...
