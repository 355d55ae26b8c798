"""Broker errors are told apart at one place per broker: a refusal of every message (an
outage: pause, no attempt charged) versus a refusal of one message (retry it alone)."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest
import redis.exceptions as rexc

from fastapi_outbox.brokers.nats.wire import ack_error, refusal_reason
from fastapi_outbox.brokers.redis.wire import refusal_code


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("!OOM command not allowed when used memory > 'maxmemory'.", "OOM"),
        ("!READONLY You can't write against a read only replica.", "READONLY"),
        ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable", "MISCONF"),
        ("LOADING Redis is loading the dataset in memory", "LOADING"),
        ("BUSY Redis is busy running a script.", "BUSY"),
        ("CLUSTERDOWN The cluster is down", "CLUSTERDOWN"),
        ("TRYAGAIN Multiple keys request during rehashing of slot", "TRYAGAIN"),
        ("MASTERDOWN Link with MASTER is down", "MASTERDOWN"),
        ("NOREPLICAS Not enough good replicas to write.", "NOREPLICAS"),
        # redis-py strips known codes from the text into status_code:
        (rexc.OutOfMemoryError("command not allowed", status_code="OOM"), "OOM"),
        (rexc.ReadOnlyError("You can't write", status_code="READONLY"), "READONLY"),
        (rexc.ResponseError("MISCONF Errors writing to the AOF file"), "MISCONF"),
    ],
)
def test_redis_outage_codes(error: object, code: str) -> None:
    assert refusal_code(error) == code  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        "!ERR The ID specified in XADD is equal or smaller than the target stream top item",
        "!WRONGTYPE Operation against a key holding the wrong kind of value",
        "!ERR string exceeds maximum allowed size (proto-max-bulk-len)",
        rexc.ResponseError("ERR unknown command"),
        "!oom in the text is not a code",
    ],
)
def test_redis_message_errors_are_not_outages(error: object) -> None:
    assert refusal_code(error) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.ServiceUnavailableError(code=503, description="JetStream unavailable"),
        nats.js.errors.APIError(code=500, err_code=10023, description="insufficient resources"),
        nats.js.errors.ServerError(code=500, err_code=10118, description="stream is offline"),
        nats.js.errors.APIError(code=500, err_code=1, description="JetStream cluster no leader"),
        nats.js.errors.APIError(code=503, err_code=10008, description="cluster not available"),
    ],
)
def test_jetstream_outages(error: BaseException) -> None:
    assert refusal_reason(error, stream_known=False) is not None


def test_no_responders_is_an_outage_only_for_a_subject_a_stream_captured() -> None:
    for error in (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError()):
        assert refusal_reason(error, stream_known=True) is not None  # type: ignore[arg-type]
        # No stream was ever found for it: the message fails (never a silent drop).
        assert refusal_reason(error, stream_known=False) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.BadRequestError(
            code=400, err_code=10054, description="message size exceeds"
        ),
        nats.js.errors.APIError(
            code=400, err_code=10060, description="expected stream does not match"
        ),
        nats.js.errors.APIError(code=503 - 103, err_code=10071, description="wrong last sequence"),
        ValueError("boom"),
    ],
)
def test_jetstream_message_errors_are_not_outages(error: BaseException) -> None:
    assert refusal_reason(error, stream_known=True) is None


# -- JetStream publish replies: read by the broker's own ack subscription --------------------


class _Reply:
    """A reply as nats-py hands it to a subscription callback."""

    def __init__(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.data = data
        self.headers = headers


@pytest.mark.parametrize(
    "data",
    [
        b'{"stream":"orders","seq":42}',
        b'{"stream":"orders","seq":42,"duplicate":true}',
        b'{"stream":"error","seq":1}',  # a stream named "error" is still an ack
        b'{"seq":7,"stream":"orders","domain":"hub"}',
    ],
)
def test_jetstream_ack_replies_are_successes(data: bytes) -> None:
    assert ack_error(_Reply(data)) is None


def test_jetstream_error_replies_become_the_matching_errors() -> None:
    unavailable = ack_error(
        _Reply(b'{"error":{"code":503,"err_code":10039,"description":"jetstream not enabled"}}')
    )
    assert isinstance(unavailable, nats.js.errors.ServiceUnavailableError)
    assert refusal_reason(unavailable, stream_known=False) is not None  # an outage
    too_big = ack_error(
        _Reply(b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds"}}')
    )
    assert isinstance(too_big, nats.js.errors.BadRequestError)
    assert too_big.err_code == 10054
    assert refusal_reason(too_big, stream_known=True) is None  # that message's fault
    no_stream = ack_error(_Reply(b"", {"Status": "503"}))
    assert isinstance(no_stream, nats.js.errors.NoStreamResponseError)


@pytest.mark.parametrize(
    ("data", "headers"),
    [
        (b"", None),
        (b"ok", None),
        (b'{"seq":1}', None),
        (b"[1, 2]", None),
        (b'{"error":"text only"}', None),
        (b"", {"Status": "408", "Description": "Request Timeout"}),
    ],
)
def test_replies_that_are_not_jetstream_acks_are_errors(
    data: bytes, headers: dict[str, str] | None
) -> None:
    """A reply from something other than JetStream (a plain subscriber on the subject)
    must never count as published."""
    error = ack_error(_Reply(data, headers))
    assert isinstance(error, nats.js.errors.APIError)
