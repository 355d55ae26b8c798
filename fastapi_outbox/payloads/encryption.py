"""Encryption of payloads with AES-GCM (``cryptography``), keys by id.

``encryption_keys`` maps key ids to keys; the last key encrypts, every key decrypts, so a
rotation adds the new key to every consumer first, then makes it the last one. A sealed
payload is the JSON string of ``base64(nonce ‖ ciphertext ‖ tag)`` (still valid JSON: the
table's JSONB column and the CloudEvents envelope carry it unchanged); the header
``encryption-key-id`` names its key. The associated data binds it to its message id, type and
stream: a ciphertext copied to another message fails authentication. Headers named in
``encrypted_headers`` travel sealed together in the header ``encrypted-headers``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi_outbox import exceptions
from fastapi_outbox.events import HEADER_ENCRYPTED_HEADERS, HEADER_ENCRYPTION_KEY_ID
from fastapi_outbox.payloads.stages import Parts, Revealed
from fastapi_outbox.settings import EncryptionKeys, check_encryption_keys

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["HEADER_ENCRYPTED_HEADERS", "HEADER_KEY_ID", "EncryptionStage", "KeyRing"]

logger = logging.getLogger("fastapi_outbox.payloads")

#: The header naming the key a payload is encrypted with.
HEADER_KEY_ID = HEADER_ENCRYPTION_KEY_ID
#: AES-GCM's standard nonce (random per message: 2**32 messages per key keep the chance of a
#: repeated nonce under 2**-32).
NONCE_BYTES = 12


def _aesgcm() -> type[AESGCM]:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise exceptions.ConfigurationError(
            "encryption_keys needs the cryptography package: "
            "pip install 'fastapi-outbox[encryption]'"
        ) from exc
    return AESGCM


class KeyRing:
    """The keys of this process by id, built from ``encryption_keys``. A callable source (a
    KMS) is called now, and again when a message names a key id the ring lacks (at most
    every ``reload_seconds``): a new key reaches running consumers without a restart."""

    def __init__(self, source: EncryptionKeys | None, *, reload_seconds: float = 30.0) -> None:
        self._source = source
        self._reload_seconds = reload_seconds
        self._loaded_at = 0.0
        self._keys: dict[str, AESGCM] = {}
        self._current: tuple[str, AESGCM] | None = None
        if source is not None:
            self._install(self._fetch())

    def _fetch(self) -> dict[str, bytes]:
        source = self._source
        raw: Mapping[str, bytes] | None
        if callable(source):
            raw = source()
            if not isinstance(raw, Mapping):
                raise exceptions.ConfigurationError(
                    "encryption_keys: the callable must return a mapping of key id to key, "
                    f"not {type(raw).__name__}"
                )
        else:
            raw = source
        try:
            return check_encryption_keys(raw or {})
        except ValueError as exc:
            raise exceptions.ConfigurationError(str(exc)) from None

    def _install(self, keys: dict[str, bytes]) -> None:
        aesgcm = _aesgcm()
        self._keys = {key_id: aesgcm(key) for key_id, key in keys.items()}
        self._current = next(reversed(self._keys.items()), None)
        self._loaded_at = time.monotonic()

    @property
    def current(self) -> tuple[str, AESGCM] | None:
        """``(key id, cipher)`` that encrypts: the last key; None without keys."""
        return self._current

    @property
    def ids(self) -> list[str]:
        return list(self._keys)

    def get(self, key_id: str) -> AESGCM | None:
        """The cipher of ``key_id``; None when this process does not hold it."""
        found = self._keys.get(key_id)
        due = time.monotonic() - self._loaded_at >= self._reload_seconds
        if found is None and callable(self._source) and due:
            self._reload()
            found = self._keys.get(key_id)
        return found

    def _reload(self) -> None:
        try:
            self._install(self._fetch())
        except Exception as exc:  # keep the keys we have; the message dead-letters
            self._loaded_at = time.monotonic()
            logger.warning(
                "encryption keys could not be reloaded",
                extra={"action": "encryption.reload_failed", "error": repr(exc)[:300]},
            )


def _aad(parts: Parts) -> bytes:
    """Associated data: a ciphertext only opens on the message it was sealed for."""
    return f"{parts.message_id}\x00{parts.type}\x00{parts.stream}".encode()


class EncryptionStage:
    """AES-GCM of payloads (and the headers named in ``encrypted_headers``)."""

    marker = HEADER_KEY_ID
    headers = frozenset({HEADER_KEY_ID, HEADER_ENCRYPTED_HEADERS})

    def __init__(
        self,
        keys: KeyRing,
        *,
        streams: list[str] | None = None,
        header_names: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.keys = keys
        self.streams = None if streams is None else frozenset(streams)
        self.header_names = frozenset(n.lower().replace("_", "-") for n in header_names)

    @property
    def seals(self) -> bool:
        return self.keys.current is not None

    # -- write ----------------------------------------------------------------------------

    def seal(self, parts: Parts, session: Any) -> Parts:
        current = self.keys.current
        if current is None or (self.streams is not None and parts.stream not in self.streams):
            return parts
        key_id, cipher = current
        aad = _aad(parts)
        headers = dict(parts.headers)
        if self.header_names:
            named = {
                name: headers.pop(name)
                for name in list(headers)
                if name.lower().replace("_", "-") in self.header_names
            }
            if named:
                plain = json.dumps(named, separators=(",", ":")).encode()
                headers[HEADER_ENCRYPTED_HEADERS] = _seal(cipher, plain, aad + b"\x00headers")
        headers[HEADER_KEY_ID] = key_id
        sealed = b'"' + _seal(cipher, parts.payload, aad).encode() + b'"'
        return Parts(parts.message_id, parts.stream, parts.type, sealed, headers)

    # -- consume --------------------------------------------------------------------------

    async def open(self, parts: Parts) -> Parts:
        return self._open(parts)

    def _open(self, parts: Parts) -> Parts:
        key_id = parts.headers.get(HEADER_KEY_ID)
        if key_id is None:
            return parts
        cipher = self.keys.get(key_id)
        where = f"message {parts.message_id} on stream {parts.stream!r}"
        if cipher is None:
            held = ", ".join(self.keys.ids) or "none"
            raise exceptions.UnknownEncryptionKey(
                f"{where} is encrypted with key id {key_id!r}, which this process does not "
                f"hold (encryption_keys holds: {held}): add the key to every consumer "
                "before a producer encrypts with it, then replay the dead letter"
            )
        aad = _aad(parts)
        text = parts.payload.strip()
        if len(text) < 2 or text[:1] != b'"' or text[-1:] != b'"':
            raise exceptions.PayloadUnreadable(
                f"{where} carries {HEADER_KEY_ID}={key_id!r} but its payload is not a "
                "sealed payload (a JSON string)"
            )
        payload = _open(cipher, text[1:-1], aad, f"{where}: the payload under key {key_id!r}")
        headers = dict(parts.headers)
        del headers[HEADER_KEY_ID]
        sealed_headers = headers.pop(HEADER_ENCRYPTED_HEADERS, None)
        if sealed_headers is not None:
            plain = _open(
                cipher,
                sealed_headers.encode(),
                aad + b"\x00headers",
                f"{where}: the encrypted headers under key {key_id!r}",
            )
            headers.update(json.loads(plain))
        return Parts(parts.message_id, parts.stream, parts.type, payload, headers)

    # -- ops ------------------------------------------------------------------------------

    async def reveal(self, parts: Parts) -> Parts | Revealed:
        key_id = parts.headers.get(HEADER_KEY_ID)
        if key_id is None:
            return parts
        clear = {k: v for k, v in parts.headers.items() if k != HEADER_ENCRYPTED_HEADERS}
        if self.keys.get(key_id) is None:
            return Revealed(f"encrypted (key {key_id})", clear)
        try:
            return self._open(parts)
        except exceptions.PayloadUnreadable as exc:
            return Revealed(f"encrypted (key {key_id}), unreadable: {exc}", clear)


def _seal(cipher: AESGCM, plain: bytes, aad: bytes) -> str:
    nonce = os.urandom(NONCE_BYTES)
    return base64.b64encode(nonce + cipher.encrypt(nonce, plain, aad)).decode()


def _open(cipher: AESGCM, sealed: bytes, aad: bytes, what: str) -> bytes:
    from cryptography.exceptions import InvalidTag

    try:
        raw = base64.b64decode(sealed, validate=True)
    except (binascii.Error, ValueError):
        raise exceptions.PayloadUnreadable(f"{what} is not base64") from None
    if len(raw) < NONCE_BYTES + 16:
        raise exceptions.PayloadUnreadable(f"{what} is too short to be a ciphertext")
    try:
        return cipher.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], aad)
    except InvalidTag:
        raise exceptions.PayloadUnreadable(
            f"{what} fails authentication: tampered with, or sealed for another message"
        ) from None
