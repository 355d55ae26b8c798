"""The JetStream ack subject read directly (``wire.sequence_and_count``) agrees with nats-py's
own ``Msg.metadata`` on both subject layouts, and refuses what is not a JetStream reply."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from fastapi_outbox.brokers.nats.wire import sequence_and_count

SUBJECTS = [
    "$JS.ACK.ORDERS.billing.3.1042.77.1795596699328000000.12",  # v1: 9 tokens
    "$JS.ACK.hub.ACCHASH.ORDERS.billing.2.981.55.1795596699328000000.0.rNd",  # v2: 12
    "$JS.ACK._.ACCHASH.ORDERS.billing.1.5.5.1795596699328000000.4",  # v2 without token
]


@pytest.mark.parametrize("reply", SUBJECTS)
def test_matches_nats_metadata(reply: str) -> None:
    msg = Msg(None, subject="orders", reply=reply, data=b"{}")  # type: ignore[arg-type]
    meta = msg.metadata
    assert sequence_and_count(msg) == (str(meta.sequence.stream), meta.num_delivered)


@pytest.mark.parametrize("reply", ["", "_INBOX.abc.1", "$JS.ACK.too.short"])
def test_not_a_jetstream_reply(reply: str) -> None:
    msg = Msg(None, subject="orders", reply=reply, data=b"{}")  # type: ignore[arg-type]
    with pytest.raises(NotJSMessageError):
        sequence_and_count(msg)
