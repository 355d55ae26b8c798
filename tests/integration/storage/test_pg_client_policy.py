"""The PostgreSQL client's liveness policy is the library's, not asyncpg's defaults: a
server that accepts a connection and never answers (a frozen process: its kernel still
completes the handshake) is an outage within ``PG_CONNECT_TIMEOUT_SECONDS`` (asyncpg waits
60 s), and every connection has TCP keep-alive on (asyncpg never sets it)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import anyio
import pytest
from sqlalchemy import text

from fastapi_outbox.storage import engine as engine_module
from fastapi_outbox.storage.engine import create_engine

pytestmark = pytest.mark.postgres(
    reason="asyncpg's client policy: connect timeout and TCP keep-alive of its sockets"
)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener never accepts nor answers: the kernel completes the TCP
    handshake (the backlog), then nothing comes back."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


async def test_a_server_that_never_answers_fails_the_connect_within_the_policy(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "PG_CONNECT_TIMEOUT_SECONDS", 0.5)
    engine = create_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{silent_port}/test", {})
    started = time.monotonic()
    try:
        with anyio.fail_after(10):  # asyncpg alone: 60 s
            with pytest.raises(TimeoutError):
                async with engine.connect():
                    pass
    finally:
        await engine.dispose()
    assert time.monotonic() - started < 5


async def test_the_policy_is_overridable_and_keeps_other_connect_args() -> None:
    opts = engine_module.engine_defaults(
        "postgresql+asyncpg://h/db", {"connect_args": {"server_settings": {"a": "b"}}}
    )
    assert opts["connect_args"] == {
        "timeout": engine_module.PG_CONNECT_TIMEOUT_SECONDS,
        "server_settings": {"a": "b"},
    }
    opts = engine_module.engine_defaults(
        "postgresql+asyncpg://h/db", {"connect_args": {"timeout": 3}}
    )
    assert opts["connect_args"] == {"timeout": 3}
    libpq = engine_module.engine_defaults("postgresql+psycopg://h/db", {})["connect_args"]
    assert libpq["keepalives"] == 1 and libpq["keepalives_idle"] == 5


async def test_every_connection_has_tcp_keepalive(pg_url: str) -> None:
    engine = create_engine(pg_url, {})
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
            raw = await conn.get_raw_connection()
            sock = raw.driver_connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            assert idle == engine_module.PG_KEEPALIVE_IDLE_SECONDS
    finally:
        await engine.dispose()
