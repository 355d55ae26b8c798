"""TCP keepalives on the LISTEN connection's socket: a connection a NAT or
firewall dropped is closed by the kernel even while no statement is in flight."""

from __future__ import annotations

import socket

import pytest

from fastapi_outbox.relay.wakeups import set_keepalive


def test_keepalive_options_are_set_on_a_tcp_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        assert set_keepalive(sock, 7.5)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if not hasattr(socket, "TCP_KEEPIDLE"):
            pytest.skip("no TCP_KEEPIDLE on this platform")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


def test_a_socket_without_tcp_options_is_left_alone() -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        assert not set_keepalive(sock, 10)
