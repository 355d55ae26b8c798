"""`Payloads`: the stages of an outbox, applied in order on write and in reverse on
consume and in ops. `build_payloads` is the one list of stages (encryption first, then
claim-check: the claim stores the ciphertext)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.payloads.claim_check import ClaimCheckStage
from fastapi_outbox.payloads.encryption import EncryptionStage, KeyRing
from fastapi_outbox.payloads.stages import Parts, PayloadStage, Revealed
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claim_check import PayloadStore

__all__ = ["Payloads", "build_payloads"]


def build_payloads(
    settings: OutboxSettings, claim_check_store: PayloadStore | None = None
) -> Payloads:
    """The payload stages of an outbox with ``settings``, in write order; claim-check's
    store (``claim_check_bytes``) is made with the outbox's storage."""
    stages: list[PayloadStage] = [
        EncryptionStage(
            KeyRing(settings.encryption_keys, reload_seconds=settings.encryption_reload_seconds),
            streams=settings.encryption_streams,
            header_names=settings.encrypted_headers,
        ),
        ClaimCheckStage(claim_check_store, settings.claim_check_bytes),
    ]
    return Payloads(stages)


class Payloads:
    """The stages, in write order; the one place each side transforms payloads."""

    def __init__(self, stages: Sequence[PayloadStage]) -> None:
        self.stages = tuple(stages)
        self._markers = tuple(stage.marker for stage in self.stages)
        self._reserved: frozenset[str] = frozenset().union(*(s.headers for s in self.stages))

    @property
    def seals(self) -> bool:
        """Whether any stage may change a message on the write path of this process."""
        return any(stage.seals for stage in self.stages)

    def refuse_reserved(self, headers: Mapping[str, str], type_name: str) -> None:
        """[`PublishError`][fastapi_outbox.PublishError] when a user header is one a
        stage sets (a forged key id would make every consumer dead-letter the message)."""
        for name in headers:
            if name.lower().replace("_", "-") in self._reserved:
                raise exceptions.PublishError(
                    f"header {name!r} of {type_name} is set by the outbox and cannot be set "
                    "by users"
                )

    # -- write ----------------------------------------------------------------------------

    def seal(
        self,
        message_id: str,
        stream: str,
        type_name: str,
        payload: str,
        headers: dict[str, str],
        session: Any,
        *,
        row: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, str]]:
        """``(payload, headers)`` of a message as it is stored and sent: each stage in
        order. ``session``: the unit of work's synchronous ``Session``. ``row``: receives
        the keys stages add to the message's first outbox row (`Parts.row`)."""
        parts = Parts(message_id, stream, type_name, payload.encode(), headers)
        for stage in self.stages:
            parts = stage.seal(parts, session)
            if row is not None and parts.row:
                row.update(parts.row)
        return parts.payload.decode(), parts.headers

    # -- consume --------------------------------------------------------------------------

    async def restore(self, d: Delivery) -> Delivery:
        """``d`` as its handler's decoder must see it: the stages undone in reverse order
        (``d`` itself when no stage sealed it — no header is parsed then). Raises
        [`PayloadUnreadable`][fastapi_outbox.testing.PayloadUnreadable] (dead-letter ``d``)."""
        markers = self._markers
        if not markers or not any(d.has_header(marker) for marker in markers):
            return d
        parts = Parts(d.message_id, d.stream, d.type, d.payload, dict(d.headers))
        for stage in reversed(self.stages):
            parts = await stage.open(parts)
        return d.restored(parts.payload, parts.headers)

    # -- ops ------------------------------------------------------------------------------

    async def reveal(
        self, message_id: str, stream: str, type_name: str, payload: str, headers: dict[str, str]
    ) -> Parts | Revealed:
        """A stored message as an operator may see it: its restored parts, or a note
        (``encrypted (key k2)``) when this process cannot read it."""
        parts = Parts(message_id, stream, type_name, payload.encode(), dict(headers))
        if not any(marker in parts.headers for marker in self._markers):
            return parts
        for stage in reversed(self.stages):
            shown = await stage.reveal(parts)
            if isinstance(shown, Revealed):
                return shown
            parts = shown
        return parts
