"""The client side of ggml's RPC backend: endpoints, a handshake before ggml connects, the relay
ggml talks to instead of the server, and what happens when a server fails inside a ggml call.

ggml's RPC client aborts the process on any failure (an unreachable endpoint, a server of
another protocol version, a failed send or recv: "Remote RPC server crashed or returned
malformed response"; ggml 0.15.3, ggml-rpc.cpp) and trusts every number a server sends. So:

* `handshake` connects with a timeout and exchanges ggml's HELLO itself before ggml is given
  anything, so a refused connection, a busy server (ggml's serves one client at a time), a
  non-RPC peer or another protocol version is a one-line `RpcError` (a friendly first look; the
  checks that protect ggml are the relay's, on ggml's own connection);
* ggml connects to a `Relay` in this process (relay.py), which checks every reply before ggml
  reads it and bounds every wait on the server (--rpc-timeout); `Connection.alive` asks it
  whether the server closed the connection since the last call, and the model raises `RpcError`
  before handing ggml a graph;
* keepalive and TCP_USER_TIMEOUT on the relay's connection turn a host that vanished without
  closing the connection into a failed recv within relay.KEEPALIVE_BOUND_S instead of a hang;
* a ggml abort while servers are connected (`guard`) ends the process with one line naming the
  server and exit code 1, instead of ggml's report and SIGABRT.

`SizedHere` spares the per-graph round trips ggml's client spends asking a CPU server what it
already knows (allocation sizes).
"""
from __future__ import annotations

import ctypes
import socket
import struct
import sys
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import ggml

from gguf_arch.errors import EXIT_RUNTIME, KimiError
from gguf_arch.errors.signals import end_process

from .protocol import CMD, COMMANDS, CONN_CAPS, PROTOCOL, REPLY_SIZE  # noqa: F401  (COMMANDS: the tests read it here)
from .relay import DEFAULT_TIMEOUT_S, Relay, recv_exactly

_HELLO_REPLY = REPLY_SIZE["HELLO"]  # major, minor, patch, padding, caps

CONNECT_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0


class RpcError(KimiError):
    """An RPC server cannot be reached, speaks another protocol, or died (exit code 1)."""

    exit_code = EXIT_RUNTIME


class EndpointError(KimiError):
    """A --rpc value is not HOST:PORT (exit code 2)."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(spec: str | Sequence[str]) -> list[Endpoint]:
    """`HOST:PORT[,HOST:PORT...]` (or a list of HOST:PORT) -> endpoints, each at most once."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Endpoint] = []
    for item in items:
        host, colon, port = str(item).strip().rpartition(":")
        # ggml splits the endpoint at its first ':' and resolves the host with gethostbyname:
        # no IPv6 literals.
        if not colon or not host or ":" in host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise EndpointError(f"--rpc {item!r}: expected HOST:PORT (an IPv4 address or host name, "
                                "a port 1..65535)")
        ep = Endpoint(host, int(port))
        if ep in out:
            raise EndpointError(f"--rpc {ep} is given twice (one ggml connection per server)")
        out.append(ep)
    if not out:
        raise EndpointError("--rpc: no endpoint given")
    return out


def handshake(ep: Endpoint, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Connect, send ggml's HELLO, check the reply's version, disconnect; returns the IPv4
    address the host resolved to. Each wait is bounded by `timeout` and the handshake's own bounds."""
    try:
        addr = socket.getaddrinfo(ep.host, ep.port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as exc:
        raise RpcError(f"RPC server {ep}: cannot resolve {ep.host!r} ({exc.strerror})") from None
    try:
        s = socket.create_connection(addr, timeout=min(CONNECT_TIMEOUT_S, timeout))
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
        raise RpcError(f"RPC server {ep}: cannot connect: {why} (is kimi-k3-rpc-server running there?)") from None
    with s:
        wait = min(HANDSHAKE_TIMEOUT_S, timeout)
        s.settimeout(wait)
        try:
            s.sendall(bytes([CMD["HELLO"]]) + struct.pack("<Q", CONN_CAPS) + bytes(CONN_CAPS))
            reply = recv_exactly(s, 8 + _HELLO_REPLY)
        except TimeoutError:
            raise RpcError(f"RPC server {ep}: no answer to the handshake within {wait:g} s "
                           "(busy with another client? a ggml RPC server serves one at a time)") from None
        except OSError as exc:
            raise RpcError(f"RPC server {ep}: connection failed during the handshake ({exc.strerror})") from None
    _check_hello(ep, reply)
    return addr[0]


def _check_hello(ep: Endpoint, reply: bytes) -> None:
    ours = ".".join(map(str, PROTOCOL))
    if len(reply) != 8 + _HELLO_REPLY or struct.unpack("<Q", reply[:8])[0] != _HELLO_REPLY:
        raise RpcError(f"RPC server {ep}: closed the connection or answered the handshake unexpectedly: not a "
                       f"ggml RPC {ours} server (llama.cpp's rpc-server speaks another protocol version; start "
                       "kimi-k3-rpc-server there)")
    major, minor, patch = reply[8:11]
    if major != PROTOCOL[0] or minor > PROTOCOL[1]:
        raise RpcError(f"RPC server {ep}: speaks ggml RPC {major}.{minor}.{patch}, this ggml speaks {ours} "
                       "(start kimi-k3-rpc-server from this package there)")


class Connection:
    """ggml's way to one server: the relay it connects to instead, and the server's health."""

    def __init__(self, endpoint: Endpoint, address: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.endpoint = endpoint
        self.address = address  # the resolved IPv4 address the handshake reached
        self.relay = Relay(str(endpoint), (address, endpoint.port), timeout)

    @property
    def ggml_endpoint(self) -> bytes:
        """What ggml is given: the relay's loopback address."""
        return self.relay.ggml_endpoint

    def attach(self) -> None:
        """Check that ggml's connection to the server exists (it does while a buffer on the
        server does). Raises RpcError if there is none."""
        if self.relay.upstream is None or not self.relay.alive():
            raise RpcError(f"RPC server {self.endpoint}: ggml's connection to it is gone")

    def alive(self) -> bool:
        """False once the server closed or reset the connection (nothing is read from it)."""
        return self.relay.alive()

    def traffic(self) -> tuple[int, int]:
        """(bytes sent and acknowledged, bytes received) on the connection to the server so far."""
        return self.relay.traffic()

    def close(self) -> None:
        self.relay.close()


class _BufferTypeIface(ctypes.Structure):
    """struct ggml_backend_buffer_type_i of ggml 0.15.3 (ggml-backend-impl.h): six function pointers."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("get_name", "alloc_buffer", "get_alignment", "get_max_size", "get_alloc_size", "is_host")]


class _BufferType(ctypes.Structure):
    _fields_ = [("iface", _BufferTypeIface), ("device", ctypes.c_void_p), ("context", ctypes.c_void_p)]


class SizedHere:
    """ggml's RPC buffer type of one server, with tensor allocation sizes computed here.

    ggml's RPC client asks the server the allocation size of every MUL_MAT_ID and FLASH_ATTN_EXT
    node each time ggml-alloc places a graph (GET_ALLOC_SIZE: a round trip each, about 3.3 per
    such node and graph, bench/rpc.py), because a GPU server may pad them. A
    kimi-k3-rpc-server serves ggml's CPU device, whose buffer type has no get_alloc_size: the
    size is ggml_nbytes. This copy of the buffer type has the same functions and context but no
    get_alloc_size, so ggml computes ggml_nbytes itself; buffers it allocates are ordinary RPC
    buffers on that server. It is for compute buffers only (the scheduler's), and must outlive
    them."""

    def __init__(self, rpc_buffer_type: int):
        self._struct = _BufferType.from_buffer_copy(_BufferType.from_address(rpc_buffer_type))
        self._struct.iface.get_alloc_size = None

    @property
    def address(self) -> int:
        return ctypes.addressof(self._struct)


def check_alive(connections: Sequence[Connection], when: str) -> None:
    """RpcError naming every server whose connection is gone."""
    dead = [str(c.endpoint) for c in connections if not c.alive()]
    if dead:
        raise RpcError(f"RPC server {', '.join(dead)}: connection lost {when} (the server stopped or its host "
                       "is unreachable)")


# ---------------------------------------------------------------------------------------------
# the abort guard
# ---------------------------------------------------------------------------------------------

# ggml's RPC client logs these just before its abort; they become part of the one error line.
_TRANSPORT_FAILURES = (b"send failed", b"recv failed", b"Failed to connect", b"Cannot resolve")


class _Guard:
    """ggml's abort and log callbacks while RPC connections exist (process-wide in ggml)."""

    def __init__(self) -> None:
        self.connections: list[Connection] = []
        self._held: deque[str] = deque(maxlen=4)
        self._abort = ggml.ggml_abort_callback_t(self._on_abort)  # kept: ggml holds the pointer
        self._log = ggml.ggml_log_callback(self._on_log)

    def add(self, c: Connection) -> None:
        if c in self.connections:
            return
        if not self.connections:
            ggml.ggml_set_abort_callback(self._abort)
            ggml.ggml_log_set(self._log, None)
        self.connections.append(c)

    def remove(self, c: Connection) -> None:
        if c in self.connections:
            self.connections.remove(c)
        if not self.connections:
            ggml.ggml_set_abort_callback(ggml.ggml_abort_callback_t())  # NULL: ggml's defaults again
            ggml.ggml_log_set(ggml.ggml_log_callback(), None)

    def _on_log(self, _level: int, text: bytes | None, _user) -> None:
        if text is None:
            return
        if text.startswith(_TRANSPORT_FAILURES):
            self._held.append(text.decode(errors="replace").strip())
        else:
            sys.stderr.write(text.decode(errors="replace"))

    def _on_abort(self, message: bytes | None) -> None:
        text = (message or b"").decode(errors="replace")
        dead = [str(c.endpoint) for c in self.connections if not c.alive()]
        if not (dead or self._held or "RPC" in text):
            sys.stderr.write(text + "\n")  # not about RPC: ggml's own report, then its abort
            return
        detail = "; ".join([*self._held, text.rsplit(": ", 1)[-1]])
        where = ", ".join(dead) if dead else ", ".join(str(c.endpoint) for c in self.connections)
        end_process(EXIT_RUNTIME, [f"error: RPC server {where}: connection lost during a ggml call ({detail}); "
                                   "ggml's RPC client cannot continue without it"])


_GUARD = _Guard()


def guard(c: Connection) -> None:
    """From now on a ggml abort while `c` exists ends the process with one line and exit 1."""
    _GUARD.add(c)


def unguard(c: Connection) -> None:
    _GUARD.remove(c)
