"""Payload stages: what happens to a message's payload and headers between the event and the
wire, in one place per side.

Write side, `Payloads.seal` (called by ``UnitOfWork.publish`` after its checks, before
the row is queued): each stage in order — encryption, then claim-check (which stores the
ciphertext). Consume side, `Payloads.restore` (called before a delivery is decoded,
for one message and for a batch): the stages in reverse — claim resolved, then decrypted.
Ops side, `Payloads.reveal` (``show``, the dashboard's message page): the payload as
this process can read it, or a note such as ``encrypted (key k2)``.
"""

from fastapi_outbox.payloads.pipeline import Payloads, build_payloads
from fastapi_outbox.payloads.stages import Parts, PayloadStage, Revealed

__all__ = ["Parts", "PayloadStage", "Payloads", "Revealed", "build_payloads"]
