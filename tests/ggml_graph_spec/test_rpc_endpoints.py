"""--rpc endpoints and the handshake that runs before ggml's client sees an endpoint.

The peers here are small loopback listeners in this process, standing in for what a user may
point --rpc at by mistake: a server that speaks another protocol version, something that is
not a ggml RPC server, a server busy with another client.
"""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from ggml_graph_spec.backends.rpc import wire
from ggml_graph_spec.backends.rpc.wire import Endpoint, EndpointError, RpcError, handshake, parse_endpoints


def test_endpoints_parse_from_a_string_or_a_list():
    want = [Endpoint("127.0.0.1", 50052), Endpoint("host-b", 1)]
    assert parse_endpoints("127.0.0.1:50052,host-b:1") == want
    assert parse_endpoints(["127.0.0.1:50052", "host-b:1"]) == want


@pytest.mark.parametrize("spec", ["", "host", ":50052", "host:", "host:0", "host:65536", "[::1]:50052", "::1:5",
                                  "host:5x"])
def test_a_malformed_endpoint_is_refused(spec):
    with pytest.raises(EndpointError):
        parse_endpoints(spec)


class _Peer:
    """A loopback listener that answers one connection with `reply` (None: read forever)."""

    def __init__(self, reply: bytes | None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = Endpoint("127.0.0.1", self.sock.getsockname()[1])
        self._reply = reply
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        self._conns.append(conn)
        conn.recv(64)
        if self._reply is not None:
            conn.sendall(self._reply)
            conn.close()

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self.sock.close()


def _hello_reply(major: int, minor: int, patch: int) -> bytes:
    return struct.pack("<Q", 28) + bytes([major, minor, patch, 0]) + bytes(24)


@pytest.mark.parametrize("reply, message", [
    (_hello_reply(7, 0, 0), "speaks ggml RPC 7.0.0, this ggml speaks 4.0.1"),
    (_hello_reply(4, 1, 0), "speaks ggml RPC 4.1.0"),  # a newer minor: ggml's client refuses it too
    (b"", "not a ggml RPC 4.0.1 server"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not a ggml RPC 4.0.1 server"),
])
def test_a_peer_that_is_not_a_matching_server_is_named(reply, message):
    peer = _Peer(reply)
    try:
        with pytest.raises(RpcError, match=message) as exc:
            handshake(peer.endpoint)
        assert str(exc.value).startswith(f"RPC server {peer.endpoint}: ")
    finally:
        peer.close()


def test_the_same_protocol_passes():
    peer = _Peer(_hello_reply(4, 0, 7))
    try:
        assert handshake(peer.endpoint) == "127.0.0.1"
    finally:
        peer.close()


def test_a_server_that_does_not_answer_is_a_bounded_wait(monkeypatch):
    """A ggml RPC server serving another client accepts the connection into its backlog and
    says nothing: the handshake gives up after HANDSHAKE_TIMEOUT_S (shortened here)."""
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT_S", 0.2)
    peer = _Peer(None)
    try:
        with pytest.raises(RpcError, match="no answer to the handshake .* serves one at a time"):
            handshake(peer.endpoint)
    finally:
        peer.close()
