"""An in-process relay between ggml's RPC client and one server: every reply checked before ggml
reads a byte of it, every wait on the server bounded.

ggml's client (C) trusts what a server sends: a device count of 2^32-1 makes it allocate until
the OOM killer comes, an alignment of 3 aborts ggml-alloc, a short reply or a silent server
aborts or hangs it; and it reads those values inside ggml calls, before Python could look. So
ggml is never given a server's address: it connects to this relay on loopback, in this process,
and the relay forwards each command to the server and each reply back, once protocol.py's checks
passed. A check that fails, a server that closes the connection or does not answer within the
timeout (--rpc-timeout) ends the process with one line naming the server and the value, exit 1:
ggml's client cannot continue a call without the reply it waits for.

Each connection of ggml's starts with HELLO; the relay then asks the server its memory on the
same connection (GET_DEVICE_MEMORY, device 0), against which buffer sizes are checked. The
transport capabilities of HELLO are zeroed both ways: nothing may move ggml's connection off
this socket. Per command the relay costs a few system calls and a copy of the bytes
(bench/rpc_relay.py measures it).
"""
from __future__ import annotations

import select
import socket
import struct
import threading
from typing import Any, Callable, NoReturn

from gguf_arch.errors import EXIT_RUNTIME
from gguf_arch.errors.signals import end_process

from .protocol import (CMD, COMMANDS, CONN_CAPS, ReplyError, ServerFacts, check_reply, reply_size)

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 600.0  # a server's reply, a layer range's graph computed before it
_STREAMED = frozenset({"SET_TENSOR", "GRAPH_COMPUTE", "GET_TENSOR"})  # payloads not held whole
_CHUNK = 1 << 20
# A vanished host: keepalive probes after 10 s idle, every 5 s, 3 unanswered -> dead (25 s);
# unacknowledged data for 25 s -> dead. A slow graph does not trip it: the server's kernel
# answers the probes.
_KEEPIDLE_S, _KEEPINTVL_S, _KEEPCNT = 10, 5, 3
KEEPALIVE_BOUND_S = _KEEPIDLE_S + _KEEPINTVL_S * _KEEPCNT


def recv_exactly(s: socket.socket, n: int) -> bytes:
    """n bytes from s, or fewer if the peer closed the connection first."""
    data = bytearray()
    while len(data) < n:
        chunk = s.recv(min(n - len(data), _CHUNK))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPIDLE_S), ("TCP_KEEPINTVL", _KEEPINTVL_S), ("TCP_KEEPCNT", _KEEPCNT),
                        ("TCP_USER_TIMEOUT", KEEPALIVE_BOUND_S * 1000)):
        if hasattr(socket, name):  # Linux; elsewhere the OS defaults apply
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def tcp_traffic(s: socket.socket) -> tuple[int, int]:
    """(bytes sent and acknowledged, bytes received) on a connection (TCP_INFO; Linux counts the
    SYN's acknowledgement as one byte sent)."""
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
    # struct tcp_info: 8 bytes of u8 fields, 24 u32, then pacing_rate, max_pacing_rate,
    # bytes_acked, bytes_received (u64 each; Linux >= 4.1).
    return struct.unpack_from("<QQ", info, 8 + 24 * 4 + 16) if len(info) >= 136 else (0, 0)


class Relay:
    """ggml's way to one server: a loopback listener in this process (`ggml_endpoint`)."""

    def __init__(self, name: str, target: tuple[str, int], timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.name, self._target, self.timeout = name, target, timeout
        self._listener = socket.create_server((LOOPBACK, 0))
        self.upstream: socket.socket | None = None  # the connection to the server of ggml's latest one
        # What the server said: its memory and alignment hold for all of ggml's connections (ggml
        # asks the alignment once per process), its buffers for the connection they were made on.
        self.facts = ServerFacts()
        threading.Thread(target=self._accept, daemon=True, name=f"kimi-k3-rpc-relay {name}").start()

    @property
    def ggml_endpoint(self) -> bytes:
        return f"{LOOPBACK}:{self._listener.getsockname()[1]}".encode()

    def fail(self, why: str) -> NoReturn:
        end_process(EXIT_RUNTIME, [f"error: RPC server {self.name}: {why}"])

    def close(self) -> None:
        """No new connections (ggml's open ones end when ggml closes them)."""
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True, name=f"kimi-k3-rpc {self.name}").start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self._target, timeout=self.timeout)
        except OSError as exc:
            self.fail(f"cannot connect: {(exc.strerror or str(exc)).lower()}")
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive(server)
        self.upstream = server
        with client, server:
            _Session(self, client, server).run()

    def alive(self) -> bool:
        """False once the server closed or reset the connection (nothing is read from it)."""
        s = self.upstream
        if s is None:
            return False
        try:
            # The socket has a timeout (a plain recv would wait for it): ask whether it is readable.
            if not select.select([s], [], [], 0)[0]:
                return True  # nothing to read: the server is waiting for the next command
            return s.recv(1, socket.MSG_PEEK) != b""  # b"": closed by the server
        except (OSError, ValueError):
            return False  # reset, or closed here

    def traffic(self) -> tuple[int, int]:
        s = self.upstream
        try:
            return tcp_traffic(s) if s is not None else (0, 0)
        except OSError:
            return 0, 0


class _ClientGone(Exception):
    """ggml closed its connection in the middle of a command (its process is ending)."""


class _Session:
    """One connection of ggml's, forwarded command by command."""

    def __init__(self, relay: Relay, client: socket.socket, server: socket.socket) -> None:
        self.relay, self.client, self.server = relay, client, server
        self.facts = relay.facts
        self.facts.buffers = {}  # a server frees a client's buffers when its connection ends
        self._buf = bytearray(_CHUNK)

    def run(self) -> None:
        while True:
            try:
                header = recv_exactly(self.client, 9)
            except OSError:
                return
            if len(header) < 9:
                return  # ggml closed its connection: the relay closes the server's
            try:
                self._command(header[0], struct.unpack_from("<Q", header, 1)[0])
            except _ClientGone:
                return

    def _command(self, cmd: int, size: int) -> None:
        name = COMMANDS[cmd] if cmd < len(COMMANDS) else f"command {cmd}"
        if name in _STREAMED and name != "GET_TENSOR":
            self._send(name, bytes([cmd]) + struct.pack("<Q", size))
            self._pass(self.client, self.server, size, name)
            request = b""
        else:
            request = self._io(name, self.client, recv_exactly, self.client, size)
            if len(request) < size:
                raise _ClientGone
            if name == "HELLO":
                request = bytes(CONN_CAPS)  # no transport upgrade: ggml's connection stays here
            self._send(name, bytes([cmd]) + struct.pack("<Q", len(request)) + request)
        expected = reply_size(name, request) if name in CMD else None
        if expected is not None:
            self._reply(name, request, expected)
        if name == "HELLO":
            self._ask_memory()
        elif name == "FREE_BUFFER":
            self.facts.buffers.pop(struct.unpack_from("<Q", request)[0], None)

    def _reply(self, name: str, request: bytes, expected: int) -> None:
        if name == "GET_TENSOR":  # tensor bytes: nothing to check in them, passed on as they come
            self._size(name, expected)
            self._io(name, self.client, self.client.sendall, struct.pack("<Q", expected))
            self._pass(self.server, self.client, expected, name)
            return
        reply = self._checked(name, request, expected)
        if name == "HELLO":
            reply = reply[:4] + bytes(CONN_CAPS)
        self._io(name, self.client, self.client.sendall, struct.pack("<Q", expected) + reply)

    def _size(self, name: str, expected: int) -> None:
        got = struct.unpack("<Q", self._recv(name, 8))[0]
        if got != expected:
            self.relay.fail(f"answered {name} with {got} bytes, {expected} expected (not a ggml RPC "
                            "server of this protocol, or a damaged connection)")

    def _checked(self, name: str, request: bytes, expected: int) -> bytes:
        """The reply to `name`, of the size the client expects and with values it may use."""
        self._size(name, expected)
        reply = self._recv(name, expected)
        try:
            check_reply(name, request, reply, self.facts)
        except ReplyError as exc:
            self.relay.fail(f"{exc} ({name}); refused before ggml used it")
        return reply

    def _ask_memory(self) -> None:
        """The server's memory, on ggml's own connection: what buffer sizes are checked against."""
        request = struct.pack("<I", 0)
        self._send("GET_DEVICE_MEMORY", bytes([CMD["GET_DEVICE_MEMORY"]]) + struct.pack("<Q", 4) + request)
        self._checked("GET_DEVICE_MEMORY", request, 16)

    def _send(self, name: str, data: bytes) -> None:
        try:
            self.server.sendall(data)
        except TimeoutError:
            self._stalled(name, "is not reading what is sent to it")
        except OSError as exc:
            self._lost(name, exc)

    def _recv(self, name: str, n: int) -> bytes:
        try:
            data = recv_exactly(self.server, n)
        except TimeoutError:
            self._stalled(name, "sent no reply")
        except OSError as exc:
            self._lost(name, exc)
        if len(data) < n:
            self._lost(name, None)
        return data

    def _pass(self, src: socket.socket, dst: socket.socket, n: int, name: str) -> None:
        """n bytes from src to dst in chunks (tensor data, graphs: not held whole)."""
        view = memoryview(self._buf)
        while n:
            got = self._io(name, src, src.recv_into, view, min(n, _CHUNK))
            if not got:
                if src is self.client:
                    raise _ClientGone
                self._lost(name, None)
            self._io(name, dst, dst.sendall, view[:got])
            n -= got

    def _io(self, name: str, side: socket.socket, op: Callable, *args: Any) -> Any:
        """op(*args) on one side's socket: a failure on ggml's side ends the session quietly (ggml
        went away), on the server's side it ends the process with the reason."""
        try:
            return op(*args)
        except TimeoutError:
            self._stalled(name, "stopped sending or reading")
        except OSError as exc:
            if side is self.client:
                raise _ClientGone from None
            self._lost(name, exc)

    def _stalled(self, name: str, what: str) -> NoReturn:
        self.relay.fail(f"{what} within {self.relay.timeout:g} s ({name}; --rpc-timeout); the server is "
                        "stalled, or its graph takes longer than that")

    def _lost(self, name: str, exc: OSError | None) -> NoReturn:
        why = "closed by the server" if exc is None or not exc.strerror else exc.strerror
        self.relay.fail(f"connection lost during a ggml call ({name}: {why}); ggml's RPC client cannot "
                        "continue without it")
