"""The one URL redaction (``fastapi_outbox.redaction``), for every form a driver accepts."""

from __future__ import annotations

import pytest

from fastapi_outbox.brokers.base import redact_url as broker_redact_url
from fastapi_outbox.log import redact as log_redact
from fastapi_outbox.redaction import redact, redact_url, remember, split_url_list


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql+asyncpg://app:s3cret@db:5432/shop",
            "postgresql+asyncpg://app:***@db:5432/shop",
        ),
        ("nats://s3cr3tT0ken@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        ("redis://onlyuser@h:6379/0", "redis://***@h:6379/0"),
        ("redis://u:p@ss@h:6379/0", "redis://u:***@h:6379/0"),
        ("rediss://:pa55word@h:6380/0", "rediss://:***@h:6380/0"),
        (
            "postgresql://h/db?password=pw1&sslmode=require",
            "postgresql://h/db?password=***&sslmode=require",
        ),
        ("redis://h/0?token=t0k&username=bob", "redis://h/0?token=***&username=***"),
        (
            "postgresql://h/db?user=alice&sslpassword=k",
            "postgresql://h/db?user=***&sslpassword=***",
        ),
        (
            "nats://tok1@h1:4222,nats://u:pw@h2:4222, nats://h3:4222",
            "nats://***@h1:4222,nats://u:***@h2:4222, nats://h3:4222",
        ),
        ("u:pw@host:5432/db", "u:***@host:5432/db"),
        ("sqlite+aiosqlite:///tmp/outbox.db", "sqlite+aiosqlite:///tmp/outbox.db"),
        ("memory://", "memory://"),
    ],
)
def test_every_url_form(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent
    assert broker_redact_url(url) == shown  # the old import paths are the same function
    if "://" in url:  # in a text, a URL is found by its scheme
        assert redact(f"could not reach {url} (refused)") == f"could not reach {shown} (refused)"
        assert log_redact(url) == shown


def test_a_comma_inside_a_password_is_not_a_list() -> None:
    assert split_url_list("nats://u:p,w@h:4222") == ["nats://u:p,w@h:4222"]
    assert split_url_list("nats://a:1,nats://b:2") == ["nats://a:1", "nats://b:2"]
    assert redact_url("nats://u:p,w@h:4222") == "nats://u:***@h:4222"


def test_keywords_and_remembered_secrets_in_free_text() -> None:
    assert redact("dsn host=h password=hunter22 user=u") == "dsn host=h password=*** user=u"
    assert redact("token: abc123 and passwd='x y'") == "token: *** and passwd='*** y'"
    # A driver quoting a secret in a form of its own (a parsed URL's repr): caught once the
    # URL was seen (an Outbox remembers its URLs).
    remember("nats://tokenQuotedElsewhere@h:4222")
    text = "ParseResult(scheme='nats', netloc='tokenQuotedElsewhere@h:4222')"
    assert "tokenQuotedElsewhere" not in redact(text)
    # A user name is not hunted in texts (it would blank ordinary words).
    remember("postgresql://postgres@h/db")
    assert redact("postgresql is up") == "postgresql is up"
