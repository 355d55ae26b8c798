"""Payload stages and AES-GCM encryption, without I/O: sealing, opening, the failures a
consumer dead-letters on (unknown key, tampering, a ciphertext moved to another message),
the environment's key list and the operator's view."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from fastapi_outbox import OutboxSettings, exceptions
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.payloads import Parts, Revealed, build_payloads
from fastapi_outbox.payloads.encryption import HEADER_ENCRYPTED_HEADERS, HEADER_KEY_ID

K1 = bytes(range(32))
K2 = bytes(range(1, 33))
MARKER = "PLAINTEXT-MARKER-7f3a"


def _delivery(payload: str, headers: dict[str, str], *, message_id: str = "m1") -> Delivery:
    return Delivery(
        stream="orders",
        entry_id="1-0",
        message_id=message_id,
        type="Placed",
        key=None,
        payload=payload.encode(),
        attempt=1,
        raw_headers=json.dumps(headers).encode(),
    )


def _seal(settings: OutboxSettings, headers: dict[str, str] | None = None) -> tuple[str, Any]:
    plain = json.dumps({"secret": MARKER})
    return build_payloads(settings).seal("m1", "orders", "Placed", plain, headers or {}, None)


async def test_sealed_payload_holds_no_plaintext_and_restores() -> None:
    settings = OutboxSettings(encryption_keys={"k1": K1})
    payload, headers = _seal(settings, {"trace": "clear"})
    assert MARKER not in payload
    assert isinstance(json.loads(payload), str)  # still JSON (the JSONB column)
    assert headers[HEADER_KEY_ID] == "k1" and headers["trace"] == "clear"
    restored = await build_payloads(settings).restore(_delivery(payload, headers))
    assert json.loads(restored.payload) == {"secret": MARKER}
    assert restored.headers == {"trace": "clear"}


async def test_encrypted_headers_setting_names_the_headers_sealed() -> None:
    settings = OutboxSettings(encryption_keys={"k1": K1}, encrypted_headers=["Card"])
    payload, headers = _seal(settings, {"card": MARKER, "trace": "clear"})
    assert "card" not in headers and HEADER_ENCRYPTED_HEADERS in headers
    assert MARKER not in json.dumps(headers)
    restored = await build_payloads(settings).restore(_delivery(payload, headers))
    assert restored.headers == {"card": MARKER, "trace": "clear"}


async def test_the_last_key_encrypts_and_every_key_decrypts() -> None:
    old = OutboxSettings(encryption_keys={"k1": K1})
    new = OutboxSettings(encryption_keys={"k1": K1, "k2": K2})
    in_flight = _seal(old)
    fresh = _seal(new)
    assert fresh[1][HEADER_KEY_ID] == "k2"
    consumer = build_payloads(new)
    for payload, headers in (in_flight, fresh):
        restored = await consumer.restore(_delivery(payload, headers))
        assert json.loads(restored.payload) == {"secret": MARKER}


async def test_unknown_key_names_the_key_id_and_message_id() -> None:
    payload, headers = _seal(OutboxSettings(encryption_keys={"k1": K1, "k2": K2}))
    consumer = build_payloads(OutboxSettings(encryption_keys={"k1": K1}))
    with pytest.raises(exceptions.UnknownEncryptionKey, match="'k2'") as info:
        await consumer.restore(_delivery(payload, headers))
    assert "m1" in str(info.value)
    keyless = build_payloads(OutboxSettings())  # no keys at all: named too
    with pytest.raises(exceptions.UnknownEncryptionKey, match="'k2'"):
        await keyless.restore(_delivery(payload, headers))


async def test_tampering_and_a_moved_ciphertext_fail_authentication() -> None:
    settings = OutboxSettings(encryption_keys={"k1": K1})
    payload, headers = _seal(settings)
    raw = bytearray(base64.b64decode(json.loads(payload)))
    raw[20] ^= 1
    tampered = json.dumps(base64.b64encode(bytes(raw)).decode())
    consumer = build_payloads(settings)
    with pytest.raises(exceptions.PayloadUnreadable, match=r"m1.*authentication"):
        await consumer.restore(_delivery(tampered, headers))
    with pytest.raises(exceptions.PayloadUnreadable, match=r"m2.*authentication"):
        await consumer.restore(_delivery(payload, headers, message_id="m2"))


async def test_clear_messages_pass_untouched_and_unparsed() -> None:
    consumer = build_payloads(OutboxSettings(encryption_keys={"k1": K1}))
    d = _delivery('{"a":1}', {"trace": "x"})
    assert await consumer.restore(d) is d


def test_streams_not_listed_stay_clear() -> None:
    settings = OutboxSettings(encryption_keys={"k1": K1}, encryption_streams=["payments"])
    payload, headers = _seal(settings)
    assert MARKER in payload and HEADER_KEY_ID not in headers


def test_users_cannot_set_the_key_id_header() -> None:
    with pytest.raises(exceptions.PublishError, match="set by the outbox"):
        build_payloads(OutboxSettings()).refuse_reserved({"Encryption-Key-Id": "k1"}, "Placed")


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    text = f"k1:{base64.b64encode(K1).decode()}, k2:{base64.b64encode(K2).decode()}"
    monkeypatch.setenv("OUTBOX_ENCRYPTION_KEYS", text)
    keys = OutboxSettings().encryption_keys
    assert keys == {"k1": K1, "k2": K2} and list(keys) == ["k1", "k2"]  # type: ignore[arg-type]
    assert "encryption_keys" not in repr(OutboxSettings())


@pytest.mark.parametrize(
    ("value", "error"),
    [("k1:notbase64!", "'k1' is not base64"), ("k1", "no key"), ("k1:AAAA", "'k1' is 3 bytes")],
)
def test_bad_keys_are_refused_naming_the_key_id(value: str, error: str) -> None:
    with pytest.raises(ValueError, match=error) as info:
        OutboxSettings(encryption_keys=value)  # type: ignore[arg-type]
    assert "AAAA" not in str(info.value)  # no key in an error


async def test_a_kms_callable_is_asked_again_for_an_unknown_key() -> None:
    held = {"k1": K1}
    calls = []

    def kms() -> dict[str, bytes]:
        calls.append(1)
        return dict(held)

    consumer = build_payloads(OutboxSettings(encryption_keys=kms, encryption_reload_seconds=0))
    held["k2"] = K2
    payload, headers = _seal(OutboxSettings(encryption_keys={"k2": K2}))
    restored = await consumer.restore(_delivery(payload, headers))
    assert json.loads(restored.payload) == {"secret": MARKER} and len(calls) == 2


async def test_reveal_says_encrypted_with_the_key_id_unless_it_holds_the_key() -> None:
    payload, headers = _seal(OutboxSettings(encryption_keys={"k1": K1, "k2": K2}))
    blind = await build_payloads(OutboxSettings()).reveal(
        "m1", "orders", "Placed", payload, headers
    )
    assert isinstance(blind, Revealed) and blind.note == "encrypted (key k2)"
    holder = build_payloads(OutboxSettings(encryption_keys={"k2": K2}))
    seen = await holder.reveal("m1", "orders", "Placed", payload, headers)
    assert isinstance(seen, Parts) and json.loads(seen.payload) == {"secret": MARKER}
