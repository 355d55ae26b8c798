"""The other versions of a consumer group: whom a message this process does not take is for.

During a rolling deploy two code versions of one group run side by side: one may take a
type the other does not know, or no longer takes. A process therefore never settles a
message that another live process of its group may handle. Each running subscriber
writes what its handler takes to ``<inbox>_handlers``
(`fastapi_outbox.storage.group_members`) when it starts and every `HEARTBEAT_SECONDS`, and
removes its row at a normal stop (a killed process's row expires after `MEMBER_TTL_SECONDS`).

A delivery whose type this process's handler does not take
(`fastapi_outbox.consume.processing.Processing.process`):

* another live process of the group takes it → handed back to the group, uncharged, after
  `hand_back_delay` (so that process, not this one, gets it);
* no live process takes it, and an ``Event`` class of this process declares the type → the
  group does not handle that type: acknowledged and skipped;
* no live process takes it and no ``Event`` class here declares it (a type newer than this
  code) → handed back until ``consumer_unknown_type_grace_seconds`` have passed since a
  process of the group first found it so, then dead-lettered with the type and the group
  in the reason.

Anything that fails while deciding (the database unreachable) hands the message back:
never settled on a guess.

It also holds the group's `Attempts`: a
redelivered message's attempt is the library's own count, not the broker's.
"""

from __future__ import annotations

import logging
import random
import time

import anyio

from fastapi_outbox.storage.group_members import ANY_TYPE, Attempts, GroupMembers

__all__ = [
    "HAND_BACK_SECONDS",
    "HEARTBEAT_SECONDS",
    "MEMBER_TTL_SECONDS",
    "Versions",
    "hand_back_delay",
]

logger = logging.getLogger("fastapi_outbox.consume")

#: A process's row says it is alive for this long after each heartbeat.
MEMBER_TTL_SECONDS = 15.0
#: Between two heartbeats of a running subscriber.
HEARTBEAT_SECONDS = MEMBER_TTL_SECONDS / 3
#: How long the other live processes' types are believed before being read again.
CACHE_SECONDS = 1.0
#: Delay before a handed-back message goes to the group again (on average: see
#: `hand_back_delay`).
HAND_BACK_SECONDS = 1.0


def hand_back_delay() -> float:
    """`HAND_BACK_SECONDS`, spread by ±50 %. Two versions that hand back each
    other's messages at the same moment would otherwise have them redelivered at the same
    moment, round after round, each to the process that just handed it back (a broker
    serves its waiting fetches in order): seen on NATS for tens of seconds. Spread, each
    redelivery is a fresh, independent turn."""
    return HAND_BACK_SECONDS * random.uniform(0.5, 1.5)


class Versions:
    """This process's row among the group's, and what the others take."""

    def __init__(
        self,
        members: GroupMembers,
        attempts: Attempts,
        member: str,
        types: str,
        grace_seconds: float,
    ) -> None:
        self.members = members
        self.attempts = attempts
        self.member = member
        self.types = types
        self.grace_seconds = grace_seconds
        #: Message ids whose counted handler run has not ended: a normal stop that
        #: cancels them gives their attempt back (`uncharge`).
        self.running: set[str] = set()
        self._others: list[frozenset[str]] = []
        self._read_at = -1e9

    @staticmethod
    def types_of(accepts: tuple[type, ...] | None) -> str:
        """The ``types`` column of a handler taking ``accepts`` (None: every type)."""
        if accepts is None:
            return ANY_TYPE
        return ",".join(sorted({c.__outbox_type__ for c in accepts}))  # type: ignore[attr-defined]

    async def join(self) -> None:
        await self.members.heartbeat(self.member, self.types, MEMBER_TTL_SECONDS)

    async def leave(self) -> None:
        try:
            await self.members.leave(self.member)
        except Exception as exc:  # the row expires anyway
            logger.debug("leaving the group's handlers table failed: %r", exc)

    async def uncharge(self, message_ids: list[str]) -> None:
        """A normal stop cancelled the counted runs of ``message_ids``: not attempts."""
        ids = [m for m in message_ids if m in self.running]
        self.running.difference_update(ids)
        if ids:
            await self.attempts.uncount(ids)

    async def keep_alive(self) -> None:
        """Heartbeats until cancelled (a failure is retried at the next one)."""
        while True:
            await anyio.sleep(HEARTBEAT_SECONDS)
            try:
                await self.join()
            except Exception as exc:
                logger.debug("group heartbeat failed: %r", exc)

    async def taken_elsewhere(self, type_: str, fetched_at: float) -> bool:
        """Whether another live process of the group takes ``type_``: read at most every
        `CACHE_SECONDS` while the answer is yes, and after ``fetched_at`` (when the
        delivery was fetched) before a no, which settles the message: a process that joined
        before the fetch is seen. One read per fetched batch at most (its deliveries share
        ``fetched_at``)."""
        now = time.monotonic()
        if now - self._read_at > CACHE_SECONDS or (
            self._read_at <= fetched_at and not self._takes(type_)
        ):
            self._others = await self.members.live_types(but=self.member)
            self._read_at = now
        return self._takes(type_)

    def _takes(self, type_: str) -> bool:
        return any(type_ in types or ANY_TYPE in types for types in self._others)
