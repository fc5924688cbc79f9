"""ggml's RPC protocol as data: its commands, the size of each reply, and the fields the client
trusts in them (ggml 0.15.3, ggml-rpc.cpp; protocol 4.0.x).

A request is the command byte, a u64 size and that many bytes; a reply (for the commands that
have one) is a u64 size and that many bytes. The client (ggml's, in C) reads each reply's numbers
and uses them at once: a device count sizes a loop of allocations, an alignment goes to
ggml-alloc's assertions, a buffer's base and size become tensor addresses. `check_reply` says
what a reply may hold; the relay (relay.py) applies it before ggml reads a byte.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import ggml

# The client accepts a server of the same major version and a minor version not above its own.
PROTOCOL = (4, 0, 1)
# The commands in enum rpc_cmd order.
COMMANDS = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
            "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
            "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE")
CMD = {name: i for i, name in enumerate(COMMANDS)}
CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: the HELLO request, and the tail of its reply
# Each command's reply size (None: no reply at all; GET_TENSOR's is the size it asked for).
REPLY_SIZE: dict[str, int | None] = {
    "ALLOC_BUFFER": 16, "GET_ALIGNMENT": 8, "GET_MAX_SIZE": 8, "BUFFER_GET_BASE": 8, "FREE_BUFFER": 0,
    "BUFFER_CLEAR": 0, "SET_TENSOR": None, "SET_TENSOR_HASH": 1, "GET_TENSOR": -1, "COPY_TENSOR": 1,
    "GRAPH_COMPUTE": None, "GET_DEVICE_MEMORY": 16, "INIT_TENSOR": 0, "GET_ALLOC_SIZE": 8,
    "HELLO": 4 + CONN_CAPS, "DEVICE_COUNT": 4, "GRAPH_RECOMPUTE": None}

# Bounds on what a server may say. One client uses device 0 of each server (kimi-k3-rpc-server
# serves one); ggml's client makes one device object per reported device.
MAX_DEVICES = 16
MAX_ALIGNMENT = 1 << 20  # ggml's backends align to 32..512 bytes; a page-aligned one is still sane

# struct rpc_tensor (packed): id u64, type u32, buffer u64, ne u32[4], nb u32[4], op u32,
# op_params i32[16], flags i32, src u64[10], view_src u64, view_offs u64, data u64, name[64], pad[4]
_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64s4s")
TENSOR_SIZE = _TENSOR.size  # 296


class ReplyError(Exception):
    """A reply that is not what the protocol allows: the message says which value and why."""


@dataclass
class ServerFacts:
    """What one connection's server said so far: later replies are checked against it."""

    total_memory: int | None = None
    alignment: int | None = None
    buffers: dict[int, int] | None = None  # remote_ptr -> size, of the buffers it allocated

    def __post_init__(self) -> None:
        self.buffers = {} if self.buffers is None else self.buffers


def tensor_nbytes(raw: bytes, offset: int = 0) -> int:
    """ggml_nbytes of the rpc_tensor at `offset` of a request (the client's own tensor)."""
    fields = _TENSOR.unpack_from(raw, offset)
    ggml_type, ne, nb = fields[1], fields[3:7], fields[7:11]
    if ggml_type >= ggml.GGML_TYPE_COUNT or any(n == 0 for n in ne):
        return 0
    blck, size = ggml.ggml_blck_size(ggml_type), ggml.ggml_type_size(ggml_type)
    if blck == 1:
        return size + sum((n - 1) * b for n, b in zip(ne, nb))
    return ne[0] * nb[0] // blck + sum((n - 1) * b for n, b in zip(ne[1:], nb[1:]))


def reply_size(name: str, request: bytes) -> int | None:
    """The size the client will read for `name` (GET_TENSOR: the size its request asked for)."""
    size = REPLY_SIZE[name]
    if size == -1:
        return struct.unpack_from("<Q", request, TENSOR_SIZE + 8)[0]
    return size


def _u64(reply: bytes, i: int = 0) -> int:
    return struct.unpack_from("<Q", reply, 8 * i)[0]


def _check_hello(reply: bytes) -> None:
    major, minor, patch = reply[:3]
    if major != PROTOCOL[0] or minor > PROTOCOL[1]:
        ours = ".".join(map(str, PROTOCOL))
        raise ReplyError(f"speaks ggml RPC {major}.{minor}.{patch}, this ggml speaks {ours}")


def _check_memory(reply: bytes, facts: ServerFacts) -> None:
    free, total = _u64(reply, 0), _u64(reply, 1)
    if total == 0 or free > total or total >= 1 << 63:
        raise ReplyError(f"reports {free} bytes free of {total} (not a memory a server can have)")
    facts.total_memory = total


def _check_alloc(reply: bytes, request: bytes, facts: ServerFacts) -> None:
    ptr, size = _u64(reply, 0), _u64(reply, 1)
    asked = struct.unpack_from("<Q", request, 4)[0]
    if ptr == 0:
        if size:
            raise ReplyError(f"refused a buffer of {asked} bytes but gave it a size of {size}")
        return
    if size < asked or (facts.total_memory is not None and size > facts.total_memory):
        raise ReplyError(f"gave a buffer of {asked} bytes the size {size} (its memory: {facts.total_memory})")
    facts.buffers[ptr] = size


def _check_base(reply: bytes, request: bytes, facts: ServerFacts) -> None:
    base, ptr = _u64(reply), struct.unpack_from("<Q", request)[0]
    size = facts.buffers.get(ptr)
    align = facts.alignment or 1
    if base == 0 or base % align or (size is not None and base + size >= 1 << 64):
        raise ReplyError(f"gave a buffer of {size} bytes the base address {base:#x} (alignment {align})")


def _check_alignment(reply: bytes, facts: ServerFacts) -> None:
    align = _u64(reply)
    if not 0 < align <= MAX_ALIGNMENT or align & (align - 1):
        raise ReplyError(f"reports an alignment of {align} (a power of two up to {MAX_ALIGNMENT} expected)")
    facts.alignment = align


def _check_alloc_size(reply: bytes, request: bytes, facts: ServerFacts) -> None:
    size, need = _u64(reply), tensor_nbytes(request, 4)
    if size < need or (facts.total_memory is not None and size > facts.total_memory):
        raise ReplyError(f"sizes a tensor of {need} bytes at {size} bytes (its memory: {facts.total_memory})")


def check_reply(name: str, request: bytes, reply: bytes, facts: ServerFacts) -> None:
    """ReplyError if `reply` (of the size the client expects) holds a value the client must not use."""
    if name == "HELLO":
        _check_hello(reply)
    elif name == "DEVICE_COUNT":
        n = struct.unpack("<I", reply)[0]
        if not 1 <= n <= MAX_DEVICES:
            raise ReplyError(f"reports {n} devices (a ggml RPC server serves 1 to {MAX_DEVICES})")
    elif name == "GET_DEVICE_MEMORY":
        _check_memory(reply, facts)
    elif name == "GET_ALIGNMENT":
        _check_alignment(reply, facts)
    elif name == "GET_MAX_SIZE" and _u64(reply) < (facts.alignment or 1):
        raise ReplyError(f"reports a largest buffer of {_u64(reply)} bytes")
    elif name == "ALLOC_BUFFER":
        _check_alloc(reply, request, facts)
    elif name == "BUFFER_GET_BASE":
        _check_base(reply, request, facts)
    elif name == "GET_ALLOC_SIZE":
        _check_alloc_size(reply, request, facts)
    elif name in ("SET_TENSOR_HASH", "COPY_TENSOR") and reply[0] > 1:
        raise ReplyError(f"answered {reply[0]} to {name} (0 or 1 expected)")
