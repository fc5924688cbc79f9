"""One sequence's state as bytes and as a file: the one format everything that saves state uses
(`Model.state_get` / `state_set`, `state_save` / `state_load`, the server's slots), as llama.cpp's
`llama_state_seq_get_data` / `set_data`.

Layout (little-endian):

    magic      8 bytes   b"KIMIK3SQ"
    version    u32       FORMAT_VERSION
    header     u32 n, then n bytes of JSON: {"model": identity (hex SHA-256, weights/identity.py),
               "cache_types": {"latent": ..., "indexer": ... or null}, "n_tokens": n,
               "parts": [[kind, bytes], ...]}
    tokens     n_tokens x i32
    parts      the sequence's part of every state tensor, in SequenceCache.state_tensors' order:
               a KDA conv or recurrent state's plane whole, an MLA latent or indexer key cache's
               first n_tokens rows (of the cache's type)
    checksum   32 bytes  SHA-256 of everything before it

A file is refused, with one line and nothing in the context changed, when it is not one
(magic), of another version, truncated or altered (checksum), from another model (identity), of
other cache types, or longer than the context's sequences.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Iterator

import ggml
import numpy as np

from gguf_arch.errors import KimiError

from ..graph.cache import SequenceCache

MAGIC = b"KIMIK3SQ"
FORMAT_VERSION = 1
_DIGEST = 32


class StateError(KimiError):
    """A sequence state that does not fit this context (exit code 2)."""


@dataclass(frozen=True)
class SeqState:
    model: str
    cache_types: dict
    tokens: list[int]
    parts: list[tuple[str, bytes]]


def _spans(cache: SequenceCache, seq: int, n_tokens: int) -> Iterator[tuple[str, object, int, int]]:
    """(kind, tensor, byte offset, byte count) of sequence seq's part of every state tensor."""
    for kind, t in cache.state_tensors():
        c = t.contents
        if kind in ("latent", "indexer"):
            yield kind, t, seq * c.nb[2], n_tokens * c.nb[1]
        else:
            plane = ggml.ggml_nbytes(t) // cache.n_seq
            yield kind, t, seq * plane, plane


def read_parts(cache: SequenceCache, seq: int, n_tokens: int) -> list[tuple[str, bytes]]:
    out = []
    for kind, t, offset, size in _spans(cache, seq, n_tokens):
        buf = np.empty(size, np.uint8)
        if size:
            ggml.ggml_backend_tensor_get(t, buf.ctypes.data, offset, size)
        out.append((kind, buf.tobytes()))
    return out


def empty_parts(cache: SequenceCache) -> list[tuple[str, bytes]]:
    """The parts of a sequence that holds nothing: zero KDA states, no cache rows."""
    return [(kind, bytes(size)) for kind, _, _, size in _spans(cache, 0, 0)]


def write_parts(cache: SequenceCache, seq: int, state: SeqState) -> None:
    """Sequence seq's part of every state tensor from `state` (already checked against cache)."""
    for (kind, t, offset, size), (_, data) in zip(_spans(cache, seq, len(state.tokens)), state.parts):
        if size:
            buf = np.frombuffer(data, np.uint8)
            ggml.ggml_backend_tensor_set(t, buf.ctypes.data, offset, size)


def encode(state: SeqState) -> bytes:
    header = json.dumps({"model": state.model, "cache_types": state.cache_types, "n_tokens": len(state.tokens),
                         "parts": [[kind, len(data)] for kind, data in state.parts]}).encode()
    body = b"".join([MAGIC, struct.pack("<II", FORMAT_VERSION, len(header)), header,
                     np.asarray(state.tokens, dtype="<i4").tobytes(), *(d for _, d in state.parts)])
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, where: str) -> SeqState:
    """Parse and verify a state; StateError naming `where` for anything but a whole, intact one."""
    if data[:len(MAGIC)] != MAGIC:
        raise StateError(f"{where}: not a kimi-k3 sequence state (expected the magic {MAGIC.decode()})")
    if len(data) < len(MAGIC) + 8 + _DIGEST:
        raise StateError(f"{where}: truncated ({len(data)} bytes)")
    version, n_header = struct.unpack_from("<II", data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise StateError(f"{where}: sequence state format version {version}; this build reads version {FORMAT_VERSION}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    start = len(MAGIC) + 8
    try:
        header = json.loads(body[start:start + n_header])
        n_tokens = int(header["n_tokens"])
        sizes = [(str(k), int(n)) for k, n in header["parts"]]
        model, types = str(header["model"]), dict(header["cache_types"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise StateError(f"{where}: truncated or damaged sequence state header ({str(exc)[:200]})") from None
    if n_tokens < 0 or any(n < 0 for _, n in sizes):  # a foreign file's header, checksum and all
        raise StateError(f"{where}: damaged: its header has a negative count")
    expected = start + n_header + 4 * n_tokens + sum(n for _, n in sizes) + _DIGEST
    if len(data) != expected:
        raise StateError(f"{where}: truncated or damaged: {len(data)} bytes, the header says {expected}")
    if hashlib.sha256(body).digest() != digest:
        raise StateError(f"{where}: damaged (its SHA-256 checksum does not match)")
    pos = start + n_header
    tokens = np.frombuffer(body, "<i4", n_tokens, pos).tolist()
    pos += 4 * n_tokens
    parts = []
    for kind, n in sizes:
        parts.append((kind, body[pos:pos + n]))
        pos += n
    return SeqState(model, types, tokens, parts)


def check_fits(state: SeqState, cache: SequenceCache, seq: int, model: str, cache_types: dict, where: str) -> None:
    """StateError unless `state` can be restored as sequence seq of this context."""
    if state.model != model:
        raise StateError(f"{where}: saved from another model (identity {state.model[:16]}..., "
                         f"this model's is {model[:16]}...)")
    if state.cache_types != cache_types:
        raise StateError(f"{where}: saved with cache types {_types(state.cache_types)}; this context has "
                         f"{_types(cache_types)}")
    if len(state.tokens) > cache.n_ctx:
        raise StateError(f"{where}: holds {len(state.tokens)} tokens; a sequence of this context holds at most "
                         f"{cache.n_ctx} (-c / -np)")
    want = [(kind, size) for kind, _, _, size in _spans(cache, seq, len(state.tokens))]
    if [(k, len(d)) for k, d in state.parts] != want:
        raise StateError(f"{where}: its layers do not match this model's caches")


def _types(types: dict) -> str:
    return ", ".join(f"{k} {v or 'none'}" for k, v in sorted(types.items()))
