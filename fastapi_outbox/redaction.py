"""The one redaction of credentials, for every URL form the drivers accept and for free text
that may quote such a URL (driver errors, log lines).

`redact_url` takes a database or broker URL and returns it safe to show:

* ``scheme://user:password@host`` → ``scheme://user:***@host`` (the user name is kept: it
  is not a secret, and operators need it to tell two accounts apart);
* ``scheme://:password@host`` (Redis ``rediss://:pass@``) → ``scheme://:***@host``;
* ``scheme://secret@host`` — a user-only part, which nats-py sends as an auth token and
  redis-py as a user name — → ``scheme://***@host``: the whole part is hidden;
* a password containing ``@`` (``redis://u:p@ss@host``, as ``urllib`` and the drivers read
  it: the user part ends at the *last* ``@``) is hidden whole;
* credentials in the query string (``?password=``, ``?token=``, ``?user=``, ``sslpassword``,
  …: any key containing pass, pwd, token, secret, user, auth, cred or key) → ``key=***``;
* comma-separated server lists (``nats://t@h1:4222,nats://u:p@h2:4222``): each URL of the
  list;
* a string without scheme (``user:pw@host``): everything before the last ``@`` is hidden.

`redact` does the same to every ``scheme://…`` URL found in a text, masks
``password=…``/``token: …`` keywords of DSN-style strings, and replaces any secret of a URL
this process has redacted or `remember`-ed (an ``Outbox`` remembers its database and
brokers' URLs), so a driver that quotes a password in a form of its own (a parsed URL's
``repr``, a keyword argument) is covered as well. Over-redaction (an ``@`` in a path or a
query value hides what precedes it) is accepted: a URL shown with less detail is safe, a
URL shown with a secret is not.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["MASK", "redact", "redact_url", "remember", "split_url_list"]

#: What a secret is replaced with.
MASK = "***"
#: Secrets shorter than this are not replaced wherever they appear in a text (only where
#: they sit in a URL): a short password would blank ordinary words.
MIN_REMEMBERED_CHARS = 6
#: At most this many remembered secrets (a process builds a handful of URLs).
MAX_REMEMBERED = 256

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
# A URL inside a text: a scheme and everything up to whitespace, a quote or a bracket.
_URL_IN_TEXT = re.compile(_SCHEME + r"[^\s'\"<>`]*")
# The commas of a server list: each one followed by another URL.
_LIST_COMMA = re.compile(r"(,\s*)(?=" + _SCHEME + ")")
# A query-string key that carries a credential.
_CREDENTIAL_KEY = r"[A-Za-z0-9_.\-]*(?:pass|pwd|token|secret|user|auth|cred|key)[A-Za-z0-9_.\-]*"
_QUERY_CREDENTIAL = re.compile(r"(?i)(?P<head>[?&;]" + _CREDENTIAL_KEY + r"=)[^&#;\s]*")
# password=secret / token: secret in DSN-style strings and keyword arguments.
_KEYWORD = re.compile(
    r"(?i)\b(?P<key>password|passwd|pwd|token|secret)(?P<sep>\s*[=:]\s*['\"]?)"
    r"(?!\*\*\*)[^\s,;&'\"]+"
)

#: Schemes whose user-only part is a token (nats-py), remembered as a secret.
_TOKEN_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})

_remembered: set[str] = set()
# Longest first (a secret may contain another); replaced whole, never mutated in place.
_by_length: tuple[str, ...] = ()


def split_url_list(url: str) -> list[str]:
    """The URLs of a comma-separated server list (``nats://h1:4222,nats://h2:4222``): split
    at each comma followed by another ``scheme://``, so a comma inside a password stays."""
    return _LIST_COMMA.split(url)[::2]


def redact_url(url: str) -> str:
    """``url`` (or a comma-separated list of URLs) with every credential masked."""
    if _LIST_COMMA.search(url):  # URLs at even places, the commas between them at odd ones
        parts = _LIST_COMMA.split(url)
        return "".join(p if i % 2 else _redact_one(p) for i, p in enumerate(parts))
    return _redact_one(url)


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        _remember_userinfo(userinfo, token_scheme=scheme.lower() in _TOKEN_SCHEMES)
        user, colon, _ = userinfo.partition(":")
        if colon and not any(c in user for c in "/?#"):
            rest = f"{user}:{MASK}@{rest}"
        else:
            rest = f"{MASK}@{rest}"
    rest = _QUERY_CREDENTIAL.sub(_mask_query_value, rest)
    return f"{scheme}{sep}{rest}"


def _mask_query_value(match: re.Match[str]) -> str:
    value = match.group(0)[len(match.group("head")) :]
    if value and "user" not in match.group("head").lower():
        _remember(unquote(value))
        _remember(value)
    return match.group("head") + MASK


def _remember_userinfo(userinfo: str, *, token_scheme: bool) -> None:
    user, colon, password = userinfo.partition(":")
    if colon:
        secret = password
    elif token_scheme:  # a user-only part is an auth token for nats-py
        secret = user
    else:  # a user name (PostgreSQL, Redis): masked in the URL, not hunted in texts
        return
    _remember(secret)
    _remember(unquote(secret))


def _remember(secret: str) -> None:
    global _by_length
    if (
        len(secret) >= MIN_REMEMBERED_CHARS
        and secret not in _remembered
        and MASK not in secret
        and len(_remembered) < MAX_REMEMBERED
    ):
        _remembered.add(secret)
        _by_length = tuple(sorted(_remembered, key=len, reverse=True))


def remember(url: str) -> None:
    """Remember the secrets of ``url`` (password, token, query credentials), so that
    `redact` masks them wherever a text quotes them."""
    redact_url(url)


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it, ``password=…``-style keywords and
    every remembered secret masked."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    text = _KEYWORD.sub(r"\g<key>\g<sep>" + MASK, text)
    for secret in _by_length:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
