"""A fake ggml RPC server that says what a test tells it to, on loopback, in this process.

It speaks ggml's protocol (backends/rpc/protocol.py) well enough for a client to connect, size
its devices and allocate: HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY, GET_ALIGNMENT, GET_MAX_SIZE,
ALLOC_BUFFER, BUFFER_GET_BASE and the commands that need no reply. `replies` replaces the payload
of a command's reply (a hostile or broken server); `silent_from` names a command from which on it
answers nothing, and holds the connection open (a stalled server); `honest_connections` serves
the first connections honestly (a server that passes a pre-check and lies to ggml afterwards). It computes nothing: tests use
it to reach a check, not a result.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Mapping

from ggml_graph_spec.backends.rpc.protocol import COMMANDS, PROTOCOL, REPLY_SIZE, TENSOR_SIZE, tensor_nbytes
from ggml_graph_spec.backends.rpc.wire import recv_exactly

LOOPBACK = "127.0.0.1"
GIB = 1 << 30


def _honest(name: str, request: bytes, state: dict) -> bytes | None:
    """The reply of a well-behaved one-device CPU server with 8 GiB."""
    if name == "HELLO":
        return bytes([*PROTOCOL, 0]) + bytes(24)
    if name == "DEVICE_COUNT":
        return struct.pack("<I", 1)
    if name == "GET_DEVICE_MEMORY":
        return struct.pack("<QQ", 6 * GIB, 8 * GIB)
    if name == "GET_ALIGNMENT":
        return struct.pack("<Q", 32)
    if name == "GET_MAX_SIZE":
        return struct.pack("<Q", (1 << 63) - 1)
    if name == "ALLOC_BUFFER":
        state["next"] = state.get("next", 0x10000) + 0x100
        return struct.pack("<QQ", state["next"], struct.unpack_from("<Q", request, 4)[0])
    if name == "BUFFER_GET_BASE":
        return struct.pack("<Q", 0x7F0000000000)
    if name == "GET_TENSOR":
        return bytes(struct.unpack_from("<Q", request, TENSOR_SIZE + 8)[0])
    if name in ("SET_TENSOR_HASH", "COPY_TENSOR"):
        return b"\0"
    if name == "GET_ALLOC_SIZE":
        return struct.pack("<Q", tensor_nbytes(request, 4))
    return b"" if REPLY_SIZE.get(name) == 0 else None


class FakeServer:
    """Serves its connections one after another, as ggml's server does. `commands` records every
    command it received, in order."""

    def __init__(self, replies: Mapping[str, bytes] | None = None, silent_from: str | None = None,
                 honest_connections: int = 0):
        self._replies, self._silent_from = dict(replies or {}), silent_from
        self._honest_left = honest_connections  # connections served honestly first (a pre-check's)
        self.commands: list[str] = []
        self._held: list[socket.socket] = []
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                self._session(conn)
            except OSError:  # the client went away (its process ended)
                conn.close()

    def _session(self, conn: socket.socket) -> None:
        state: dict = {}
        honest, self._honest_left = self._honest_left > 0, self._honest_left - 1
        while len(header := recv_exactly(conn, 9)) == 9:
            name = COMMANDS[header[0]] if header[0] < len(COMMANDS) else "?"
            request = recv_exactly(conn, struct.unpack_from("<Q", header, 1)[0])
            self.commands.append(name)
            if name == self._silent_from and not honest:
                self._held.append(conn)  # open and silent: the client waits for a reply
                return
            reply = _honest(name, request, state) if honest else self._replies.get(name, _honest(name, request, state))
            if reply is not None:
                conn.sendall(struct.pack("<Q", len(reply)) + reply)
        conn.close()

    def close(self) -> None:
        self._listener.close()
        for c in self._held:
            c.close()

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
