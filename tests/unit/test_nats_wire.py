"""The NATS wire format (``brokers/nats/wire.py``), without a server: the headers a
message is published with, the ``HPUB`` header block (nats-py's header rules), the size
check against ``max_payload``, subjects NATS refuses, what a publish reply means and how a
pulled message is read back into a delivery."""

from __future__ import annotations

import json

import nats.js.errors
import pytest
from nats.aio.msg import Msg

from fastapi_outbox.brokers.nats.wire import (
    KEY_HEADER,
    MSG_ID_HEADER,
    ack_error,
    decode_message,
    exceeds_max_payload,
    header_block,
    hpub_command,
    invalid_subject,
    is_unreachable,
    publish_headers,
    stream_name_for,
    wire_size,
)
from fastapi_outbox.events import Envelope

ACK_SUBJECT = "$JS.ACK.ORDERS.billing.3.1042.77.1795596699328000000.12"


def envelope(*, key: str | None = "k-1", headers: dict[str, str] | None = None) -> Envelope:
    return Envelope(
        "0190-id",
        "orders",
        "OrderPlaced",
        key,
        b'{"n":1}',
        headers if headers is not None else {"message-id": "m-1", "type": "OrderPlaced"},
    )


def msg(headers: dict[str, str] | None, data: bytes = b"{}", reply: str = ACK_SUBJECT) -> Msg:
    return Msg(None, subject="orders", reply=reply, data=data, headers=headers)  # type: ignore[arg-type]


def test_publish_headers_carry_key_and_dedup_id_last() -> None:
    headers = publish_headers(envelope())
    assert headers[KEY_HEADER] == "k-1"
    assert headers[MSG_ID_HEADER] == "0190-id"
    assert list(headers)[-1] == MSG_ID_HEADER


def test_a_user_header_cannot_replace_the_dedup_id() -> None:
    e = envelope(key=None, headers={MSG_ID_HEADER: "forged", "type": "T"})
    headers = publish_headers(e)
    assert headers[MSG_ID_HEADER] == "0190-id" and KEY_HEADER not in headers


def test_header_block_follows_nats_rules() -> None:
    block = header_block({" x-note ": "  two\r\nlines ", "": "skipped", "type": "T"})
    assert block == b"NATS/1.0\r\nx-note: two  lines\r\ntype: T\r\n\r\n"


def test_header_block_names_a_bad_header_name() -> None:
    with pytest.raises(ValueError, match="invalid NATS header name 'bad name'"):
        header_block({"bad name": "x"})


def test_wire_size_counts_payload_and_header_lines() -> None:
    assert wire_size(b"abc", {"a": "b", "type": "T"}) == 3 + len(b"a: b\r\n") + len(b"type: T\r\n")


def test_max_payload_check() -> None:
    e = envelope()
    headers = publish_headers(e)
    assert not exceeds_max_payload(e, headers, 1024 * 1024)
    big = Envelope("0190-id", "orders", "T", None, b"x" * 2000, {})
    assert exceeds_max_payload(big, publish_headers(big), 1024)


@pytest.mark.parametrize(("subject", "bad"), [("orders.eu", False), ("", True), ("a b", True)])
def test_invalid_subjects(subject: str, bad: bool) -> None:
    assert invalid_subject(subject) is bad
    assert invalid_subject("a\r\nPUB x 1") is True


def test_stream_names() -> None:
    assert stream_name_for("orders.eu") == "orders_eu"
    assert stream_name_for("a*b>c") == "a_b_c"


def test_ack_error_reads_acks_and_errors() -> None:
    assert ack_error(msg(None, b'{"stream":"orders","seq":42}')) is None
    assert ack_error(msg(None, b'{"seq":42, "stream":"orders"}')) is None
    no_stream = ack_error(msg({"Status": "503"}, b""))
    assert isinstance(no_stream, nats.js.errors.NoStreamResponseError)
    refused = ack_error(msg(None, json.dumps({"error": {"code": 503, "err_code": 10039}}).encode()))
    assert isinstance(refused, nats.js.errors.ServiceUnavailableError)
    impostor = ack_error(msg(None, b"ok"))
    assert isinstance(impostor, nats.js.errors.APIError)
    assert "unexpected reply" in str(impostor.description)


def test_decode_message_reads_ids_key_and_headers() -> None:
    headers = {
        "message-id": "m-1",
        "type": "OrderPlaced",
        KEY_HEADER: "k-1",
        MSG_ID_HEADER: "0190-id",
        "x-tenant": "t1",
    }
    d = decode_message("orders", msg(headers, b'{"n":1}'))
    assert (d.stream, d.entry_id, d.attempt) == ("orders", "1042", 3)
    assert (d.message_id, d.type, d.key) == ("m-1", "OrderPlaced", "k-1")
    assert d.payload == b'{"n":1}'
    # Nats-* and the ordering key are transport headers, not the message's.
    assert d.headers == {"message-id": "m-1", "type": "OrderPlaced", "x-tenant": "t1"}


def test_decode_message_without_outbox_headers_falls_back() -> None:
    d = decode_message("orders", msg({MSG_ID_HEADER: "dedup-1"}))
    assert (d.message_id, d.type, d.key) == ("dedup-1", "", None)
    bare = decode_message("orders", msg(None))
    assert bare.message_id == "1042" and bare.headers == {}


def test_unreachable_is_told_per_kind_of_call() -> None:
    import nats.errors

    for error in (
        nats.errors.ConnectionClosedError(),
        nats.errors.ConnectionReconnectingError(),
        nats.errors.NoRespondersError(),
        nats.errors.TimeoutError(),
    ):
        assert is_unreachable(error)  # a JetStream API request
    assert is_unreachable(nats.errors.OutboundBufferLimitError(), request=False)
    assert is_unreachable(nats.errors.ConnectionClosedError(), request=False)
    # "No responders" to a publish is refusal_reason's to tell (stream known or not).
    assert not is_unreachable(nats.errors.NoRespondersError(), request=False)
    assert not is_unreachable(nats.js.errors.APIError(code=400, description="bad"))


def test_hpub_command_counts_header_and_total_bytes() -> None:
    command = hpub_command("orders", "_INBOX.x.1", {"type": "T"}, b'{"n":1}')
    block = b"NATS/1.0\r\ntype: T\r\n\r\n"
    assert command == (
        b"HPUB orders _INBOX.x.1 %d %d\r\n" % (len(block), len(block) + 7) + block + b'{"n":1}\r\n'
    )


@pytest.mark.parametrize(
    "name", ["x-tenant", "encryption-key-id", KEY_HEADER, MSG_ID_HEADER, "nats-msg-id", "type"]
)
def test_has_header_answers_as_the_headers_do_without_building_them(name: str) -> None:
    headers = {
        "message-id": "m-1",
        "type": "OrderPlaced",
        KEY_HEADER: "k-1",
        MSG_ID_HEADER: "0190-id",
        "nats-msg-id": "x",
        "x-tenant": "t1",
    }
    d = decode_message("orders", msg(headers))
    answer = d.has_header(name)
    assert d._headers is None  # the payload stages' check parses nothing
    assert answer == (name in d.headers)
    assert d.has_header(name) == answer  # and the same once the headers are built
    assert decode_message("orders", msg(None)).has_header(name) is False
