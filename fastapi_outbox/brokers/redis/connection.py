"""``RedisConnection``: the ``redis.asyncio`` client a Redis publisher and its consumers
share, and what both need to know of the server.

It owns the client (made from the URL on ``connect``, or the caller's, which it never
closes), the server's version (read once per connection), the stream key prefix and the
translation of a client failure into
[`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable] / ``BrokerTimeout``. The publisher
and the consumer each receive this object and never read each other (faststream's
``redis/configs/state.py`` is the example). redis-py reconnects a dropped connection by
itself on the next command; ``connect`` after ``aclose`` opens a new client.

A Redis Cluster (``redis+cluster://host:port[,host:port…]``, ``rediss+cluster://`` with
TLS, or a caller's ``redis.asyncio.cluster.RedisCluster``) gets redis-py's cluster client,
which follows ``MOVED`` / ``ASK`` and refreshes its slot map after a failover;
`RedisConnection.cluster` then tells the publisher and the consumer to keep every
multi-key command in one slot (``wire.dedup_key``, ``wire.dead_letter_key``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.redis.wire import (
    dead_letter_key,
    dedup_key,
    is_authentication_failure,
)
from fastapi_outbox.redaction import redact_url

__all__ = [
    "CLUSTER_SCHEMES",
    "SOCKET_TIMEOUT_SECONDS",
    "RedisConnection",
    "cluster_startup_nodes",
    "cluster_url",
    "is_cluster_url",
]

logger = logging.getLogger("fastapi_outbox.brokers.redis")

#: Longest wait for one Redis reply (and for a connection) before it counts as an outage.
SOCKET_TIMEOUT_SECONDS = 5.0
#: How often redis-py checks an idle connection before using it.
HEALTH_CHECK_INTERVAL_SECONDS = 30
#: TCP keep-alive of every connection: probes after 5 s idle, every 2 s, 3 lost = dead.
#: A peer that vanished (frozen node, cut network) is found by the kernel in ~11 s even
#: on a connection the library is not using; a used one fails at ``socket_timeout``.
KEEPALIVE_IDLE_SECONDS, KEEPALIVE_INTERVAL_SECONDS, KEEPALIVE_PROBES = 5, 2, 3
#: URL schemes of a Redis Cluster, and the scheme of one of its nodes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def cluster_startup_nodes(url: str) -> tuple[list[tuple[str, int]], str]:
    """The startup nodes of a ``redis+cluster://[user:password@]host:port[,host:port…]
    [/0][?option=value…]`` URL (port 6379 when not given; ``[::1]:7000`` for IPv6), and
    the URL of its first node with the credentials and options (``redis://`` or
    ``rediss://``), which redis-py parses into the connection options of every node.
    ConfigurationError for a URL that names no node or a database other than 0."""
    scheme, _, rest = url.partition("://")
    node_scheme = CLUSTER_SCHEMES.get(scheme.lower())
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for item in filter(None, (h.strip() for h in hosts.split(","))):
        if item.startswith("["):  # [IPv6]:port
            host, _, port = item[1:].partition("]")
            port = port.removeprefix(":")
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            nodes.append((host, int(port or 6379)))
        except ValueError:
            nodes = []
            break
    path = tail.partition("?")[0].strip("/")
    if node_scheme is None or not nodes or not all(h for h, _ in nodes) or path not in ("", "0"):
        raise exceptions.ConfigurationError(
            f"RedisStreamsBroker: {redact_url(url)!r} is not a Redis Cluster URL: use "
            "redis+cluster://[user:password@]host:port[,host:port…] (database 0 only)"
        )
    first_host, first_port = nodes[0]
    host = f"[{first_host}]" if ":" in first_host else first_host
    return nodes, f"{node_scheme}://{userinfo}{at}{host}:{first_port}{tail}"


def cluster_url(nodes: list[str] | tuple[str, ...]) -> str:
    """The ``redis+cluster://`` URL of a list of startup nodes, each ``host:port`` or a node
    URL (``redis://[user:password@]host:port``; the first one's scheme, credentials and
    options count for all)."""
    if not nodes or not all(isinstance(n, str) and n for n in nodes):
        raise exceptions.ConfigurationError(
            "RedisStreamsBroker: a Redis Cluster's startup nodes must be a non-empty list "
            "of 'host:port' or 'redis://host:port' strings"
        )
    first = nodes[0] if "://" in nodes[0] else f"redis://{nodes[0]}"
    scheme, _, rest = first.partition("://")
    if scheme.lower() not in ("redis", "rediss"):
        raise exceptions.ConfigurationError(
            f"RedisStreamsBroker: startup node {redact_url(first)!r} is not a redis:// or "
            "rediss:// URL"
        )
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, host = netloc.rpartition("@")
    others = [n.rpartition("://")[2].rpartition("@")[2].split("/")[0] for n in nodes[1:]]
    return f"{scheme}+cluster://{userinfo}{at}{','.join([host, *others])}{tail}"


def keepalive_options() -> dict[int, int]:
    """The TCP keep-alive options of every connection the library opens (where the
    platform has them)."""
    import socket

    wanted = {
        "TCP_KEEPIDLE": KEEPALIVE_IDLE_SECONDS,
        "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_SECONDS,
        "TCP_KEEPCNT": KEEPALIVE_PROBES,
    }
    return {getattr(socket, n): v for n, v in wanted.items() if hasattr(socket, n)}


def _is_cluster_client(client: Any) -> bool:
    try:
        from redis.asyncio.cluster import RedisCluster
    except ImportError:  # pragma: no cover - a client object means redis is installed
        return False
    return isinstance(client, RedisCluster)


def _describe(client: Any) -> str:
    """A URL naming the server(s) of a caller's client, for logs and errors."""
    if _is_cluster_client(client):
        nodes = getattr(client, "startup_nodes", None) or client.get_nodes()
        return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in nodes)
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}"


class RedisConnection:
    """The Redis client of one broker, shared by its publisher and its consumers."""

    def __init__(
        self,
        url: Any = "redis://localhost:6379/0",
        *,
        client: Any = None,
        socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
        stream_prefix: str = "",
    ) -> None:
        """``url`` is a URL, a list of a Redis Cluster's startup nodes (``cluster_url``), or
        a ready ``redis.asyncio`` client (``Redis`` or ``RedisCluster``), as is ``client``;
        a caller's client is never closed here."""
        if isinstance(url, list | tuple):
            url = cluster_url(url)
        elif not isinstance(url, str):
            client, url = url, _describe(url)
        elif _is_cluster_client(client) and not is_cluster_url(url):
            url = _describe(client)  # not the single-node default URL: the cluster's nodes
        if is_cluster_url(url):
            cluster_startup_nodes(url)  # a bad cluster URL fails here, not on connect
        self.url: str = url
        #: A Redis Cluster: every multi-key command stays in one slot.
        self.cluster = is_cluster_url(url) if client is None else _is_cluster_client(client)
        #: Bounds every command of the client (and the consumer's own reads).
        self.socket_timeout = socket_timeout
        self.stream_prefix = stream_prefix
        #: (major, minor) of the server, read by ``connect``; None before.
        self.server_version: tuple[int, ...] | None = None
        self._client = client
        self._own_client = client is None

    def __repr__(self) -> str:
        return f"RedisConnection({redact_url(self.url)!r})"

    @property
    def client(self) -> Any:
        """The ``redis.asyncio.Redis`` client; BrokerUnavailable before ``connect``."""
        if self._client is None:
            raise exceptions.BrokerUnavailable(f"Redis at {redact_url(self.url)} is not connected")
        return self._client

    @property
    def connected(self) -> bool:
        """Whether ``connect`` has made the client and read the server's version."""
        return self._client is not None and self.server_version is not None

    def stream_key(self, stream: str) -> str:
        """The Redis key of ``stream`` (the broker's ``stream_prefix`` prepended)."""
        return self.stream_prefix + stream

    def dedup_key(self, stream_key: str, message_id: str) -> str:
        """The de-duplication key of ``message_id`` in ``stream_key`` (``wire.dedup_key``)."""
        return dedup_key(stream_key, message_id, cluster=self.cluster)

    def dead_letter_key(self, dead_letter: str, stream_key: str) -> str:
        """The key of the dead-letter stream ``dead_letter`` of ``stream_key`` (prefixed;
        on a cluster in the stream's slot: ``wire.dead_letter_key``)."""
        return dead_letter_key(self.stream_key(dead_letter), stream_key, cluster=self.cluster)

    def _make_client(self) -> Any:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        options: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "health_check_interval": HEALTH_CHECK_INTERVAL_SECONDS,
            # No retries inside the client (redis-py 6+ retries three times with up to 10 s
            # of backoff by default): a failed command is an outage the relay and the
            # consumer see at once and handle with their own backoff, so a lost connection
            # is never hidden behind the client's defaults.
            "retry": Retry(NoBackoff(), 0),
            "socket_keepalive": True,
            "socket_keepalive_options": keepalive_options(),
        }
        if not self.cluster:
            import redis.asyncio as aioredis

            return aioredis.Redis.from_url(self.url, **options)
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.connection import SSLConnection, parse_url

        nodes, node_url = cluster_startup_nodes(self.url)
        parsed: dict[str, Any] = dict(parse_url(node_url))
        for name in ("host", "port", "db"):
            parsed.pop(name, None)
        if parsed.pop("connection_class", None) is SSLConnection:
            parsed["ssl"] = True
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            **{**options, **parsed},
        )

    async def connect(self) -> None:
        """Make the client (unless the caller gave one) and read the server's version;
        idempotent. BrokerUnavailable when Redis cannot be reached."""
        if self._client is None:
            self._client = self._make_client()
        if self.server_version is None:
            try:
                info = await self._client.info("server")  # a cluster: its default node
            except Exception as exc:
                raise self.unavailable(exc) from exc
            version = str(info.get("redis_version", "0"))
            self.server_version = tuple(int(p) for p in version.split(".")[:2])

    async def aclose(self) -> None:
        """Close the client this connection made (a caller's client stays open);
        idempotent. The next ``connect`` opens a new one."""
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None
            self.server_version = None

    async def ping(self) -> None:
        """BrokerUnavailable unless Redis answers a PING (connecting first if needed)."""
        try:
            await self.connect()  # a ping before connect asks the server, not the object
            if self.cluster:  # every master: each serves a part of the streams
                await self.client.ping(target_nodes="primaries")
            else:
                await self.client.ping()
        except exceptions.BrokerUnavailable:
            raise
        except Exception as exc:
            raise self.unavailable(exc) from exc

    def unavailable(self, exc: BaseException) -> exceptions.BrokerUnavailable:
        """The outage ``exc`` (a connection failure or a timeout of the client, a cluster
        node or slot map out of reach: ``wire.is_unreachable``) means:
        BrokerTimeout when Redis did not answer in ``socket_timeout``, else
        BrokerUnavailable; both name the server (credentials redacted)."""
        import redis.exceptions as rexc

        if is_authentication_failure(exc):
            return exceptions.AuthenticationFailed(
                f"Redis at {redact_url(self.url)}: authentication failed "
                f"({type(exc).__name__}: {exc}): check the user and password of the URL"
            )
        if isinstance(exc, rexc.TimeoutError):
            # No answer in ``socket_timeout``: the relay pings to tell a frozen server
            # from a call that hangs on what it carries.
            return exceptions.BrokerTimeout(
                f"Redis at {redact_url(self.url)} did not answer in time: "
                f"{type(exc).__name__}: {exc}"
            )
        return exceptions.BrokerUnavailable(
            f"Redis at {redact_url(self.url)} is unreachable: {type(exc).__name__}: {exc}"
        )

    def refusing(self, code: str, exc: BaseException | str) -> exceptions.BrokerRefusing:
        """The outage a broker-wide refusal (``wire.refusal_code``) means."""
        return exceptions.BrokerRefusing(
            f"Redis at {redact_url(self.url)} refuses commands ({code}): {exc}"
        )
