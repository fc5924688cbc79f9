"""The client side of ggml's RPC backend: endpoints, a handshake before ggml connects, and the
health of ggml's connections.

ggml's RPC client aborts the process on any failure: an unreachable endpoint
(`ggml_backend_rpc_init` -> GGML_ASSERT), a server speaking another protocol version, and any
failed send or recv afterwards ("Remote RPC server crashed or returned malformed response";
ggml 0.15.3, ggml-rpc.cpp). This module keeps those aborts away from the user:

* `handshake` connects with a timeout and exchanges ggml's HELLO itself before ggml is given the
  endpoint, so a refused connection, a busy server (ggml's serves one client at a time), a
  non-RPC peer or another protocol version is a one-line `RpcError`;
* `Connection.alive` looks at ggml's own socket (found by its peer address) without reading from
  it: a server that died since the last call has closed it, and the model raises `RpcError`
  before handing ggml a graph;
* keepalive and TCP_USER_TIMEOUT on that socket turn a host that vanished without closing
  the connection into a failed recv within KEEPALIVE_BOUND_S instead of a hang;
* a server dying while ggml is inside a call cannot be recovered from (ggml aborts right after
  the callback returns): `guard` installs a ggml abort callback that names the lost endpoint on
  one line and ends the process with exit code 1.

`SizedHere` spares the per-graph round trips ggml's client spends asking a CPU server what it
already knows (allocation sizes).
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import ggml

from gguf_arch.errors import EXIT_RUNTIME, KimiError

# ggml 0.15.3's RPC protocol (ggml-rpc.h): the client accepts a server of the same major
# version and a minor version not above its own.
PROTOCOL = (4, 0, 1)
# Its commands in enum rpc_cmd order (ggml-rpc.cpp). A request is the command byte, a u64 size
# and that many bytes; a reply (for the commands that have one) a u64 size and the bytes.
COMMANDS = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
            "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
            "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE")
_CMD_HELLO = COMMANDS.index("HELLO")  # 14 in every protocol version
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: the HELLO request, and the tail of the reply
_HELLO_REPLY = 4 + _CONN_CAPS  # major, minor, patch, padding, caps

CONNECT_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0
# A vanished host: keepalive probes after 10 s idle, every 5 s, 3 unanswered -> dead (25 s);
# unacknowledged data for 25 s -> dead. A slow graph does not trip it: the server's kernel
# answers the probes.
_KEEPIDLE_S, _KEEPINTVL_S, _KEEPCNT = 10, 5, 3
KEEPALIVE_BOUND_S = _KEEPIDLE_S + _KEEPINTVL_S * _KEEPCNT


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


def recv_exactly(s: socket.socket, n: int) -> bytes:
    """n bytes from s, or fewer if the peer closed the connection first."""
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def handshake(ep: Endpoint) -> str:
    """Connect, send ggml's HELLO, check the reply's version, disconnect; returns the IPv4
    address the host resolved to (ggml's client resolves it the same way)."""
    try:
        addr = socket.getaddrinfo(ep.host, ep.port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as exc:
        raise RpcError(f"RPC server {ep}: cannot resolve {ep.host!r} ({exc.strerror})") from None
    try:
        s = socket.create_connection(addr, timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
        raise RpcError(f"RPC server {ep}: cannot connect: {why} (is kimi-k3-rpc-server running there?)") from None
    with s:
        s.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            s.sendall(bytes([_CMD_HELLO]) + struct.pack("<Q", _CONN_CAPS) + bytes(_CONN_CAPS))
            reply = recv_exactly(s, 8 + _HELLO_REPLY)
        except TimeoutError:
            raise RpcError(f"RPC server {ep}: no answer to the handshake within {HANDSHAKE_TIMEOUT_S:.0f} s "
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


def _tcp_socket(fd: int) -> socket.socket | None:
    """A duplicate of fd as a socket object (closing it leaves ggml's fd open), or None.

    The duplicate shares the file status flags with ggml's descriptor: it must stay blocking
    (ggml's recv fails on EAGAIN), so the object is put back in blocking mode if a process-wide
    socket.setdefaulttimeout made Python switch it, and reads use MSG_DONTWAIT instead."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    if s.gettimeout() is not None:
        s.settimeout(None)
    return s


def _open_fds() -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: every descriptor number below the limit
        return list(range(os.sysconf("SC_OPEN_MAX")))


class Connection:
    """ggml's connection to one server, watched through its socket descriptor."""

    def __init__(self, endpoint: Endpoint, address: str):
        self.endpoint = endpoint
        self.address = address  # the resolved IPv4 address the handshake reached
        self._fd: int | None = None
        self._local: tuple | None = None

    @property
    def ggml_endpoint(self) -> bytes:
        """What ggml is given: the address the handshake reached, so that its socket is this one."""
        return f"{self.address}:{self.endpoint.port}".encode()

    def attach(self) -> None:
        """Find ggml's socket to the server (it exists while a buffer on the server does) and set
        keepalive on it. Raises RpcError if there is none."""
        peer = (self.address, self.endpoint.port)
        taken = {c._fd for c in _GUARD.connections if c is not self}
        for fd in _open_fds():
            if fd in taken:
                continue
            s = _tcp_socket(fd)
            if s is None:
                continue
            with s:
                try:
                    if s.family != socket.AF_INET or s.getpeername() != peer:
                        continue
                    local = s.getsockname()
                except OSError:
                    continue
                _keepalive(s)
            self._fd, self._local = fd, local
            return
        raise RpcError(f"RPC server {self.endpoint}: ggml's connection to it is gone")

    def alive(self) -> bool:
        """False once the server closed or reset ggml's connection (nothing is read from it)."""
        s = _tcp_socket(self._fd) if self._fd is not None else None
        if s is None:
            return False
        with s:
            try:
                if s.getsockname() != self._local:
                    return False  # ggml closed it and the number was reused
                return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""  # b"": closed by the server
            except BlockingIOError:
                return True  # nothing to read: the server is waiting for the next command
            except OSError:
                return False  # reset

    def traffic(self) -> tuple[int, int]:
        """(bytes sent and acknowledged, bytes received) on ggml's connection so far (TCP_INFO;
        Linux counts the SYN's acknowledgement as one byte sent)."""
        s = _tcp_socket(self._fd) if self._fd is not None else None
        if s is None:
            return 0, 0
        with s:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
        # struct tcp_info: 8 bytes of u8 fields, 24 u32, then pacing_rate, max_pacing_rate,
        # bytes_acked, bytes_received (u64 each; Linux >= 4.1).
        return struct.unpack_from("<QQ", info, 8 + 24 * 4 + 16) if len(info) >= 136 else (0, 0)


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


def _keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPIDLE_S), ("TCP_KEEPINTVL", _KEEPINTVL_S), ("TCP_KEEPCNT", _KEEPCNT),
                        ("TCP_USER_TIMEOUT", KEEPALIVE_BOUND_S * 1000)):
        if hasattr(socket, name):  # Linux; elsewhere the OS defaults apply
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


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
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        sys.stderr.write(f"error: RPC server {where}: connection lost during a ggml call ({detail}); ggml's RPC "
                         "client cannot continue without it\n")
        sys.stderr.flush()
        os._exit(EXIT_RUNTIME)


_GUARD = _Guard()


def guard(c: Connection) -> None:
    """From now on a ggml abort while `c` exists ends the process with one line and exit 1."""
    _GUARD.add(c)


def unguard(c: Connection) -> None:
    _GUARD.remove(c)
