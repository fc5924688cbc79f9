"""The digests of a GGUF's integrity manifest: which hash functions, and hashing bytes as they stream.

BLAKE3 is what manifests are written with: on this project's machine (AMD EPYC, AVX-512) it costs
about 0.22 CPU-s per GB against SHA-256's 0.58-0.88 (bench/convert.py measures both each run),
and one hasher spreads a large update over several cores (`max_threads`: its tree of 1 KiB
chunks is hashed in parallel), so the digest is not a single-core stage on a many-core machine.
SHA-256 stays readable: manifests written before BLAKE3 name it, and --verify, --resume and the
fuzzers check a GGUF against them with the same code.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import blake3

from .pipeline import SerialWorker

BLAKE3, SHA256 = "blake3", "sha256"
HASHES = (BLAKE3, SHA256)
HEX_DIGITS = 64  # both are 256-bit digests
_READ_BYTES = 16 << 20


class Hash(Protocol):
    def update(self, data, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hash(name: str, threads: int = 1) -> Hash:
    """A fresh hasher of algorithm `name` (one of HASHES); BLAKE3 may use `threads` cores."""
    if name == BLAKE3:
        return blake3.blake3(max_threads=max(1, threads))
    if name == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown hash {name!r} (expected one of {', '.join(HASHES)})")


def hash_bytes(name: str, data) -> str:
    h = new_hash(name)
    h.update(data)
    return h.hexdigest()


class TruncatedError(EOFError):
    """The file ended before the range to hash did."""


def hash_range(name: str, path: Path, start: int, nbytes: int, threads: int = 1) -> str:
    """The digest of `nbytes` of `path` from `start`, from plain 16 MiB reads (hashing 1.5 TB must
    not map it all into the RSS). TruncatedError when the file is shorter."""
    h = new_hash(name, threads)
    with open(path, "rb") as f:
        f.seek(start)
        while nbytes:
            block = f.read(min(nbytes, _READ_BYTES))
            if not block:
                raise TruncatedError(f"{path}: ends before byte {start} + {nbytes} (truncated)")
            h.update(block)
            nbytes -= len(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TensorDigest:
    name: str
    ggml_type: str
    nbytes: int
    digest: str  # hex, of the manifest's hash


# Chunks handed to the hashing thread and not yet hashed (bounded, like the writer's queue).
HASH_AHEAD = 2


class TensorHasher:
    """Wraps the writer's `chunks_for` so each tensor's bytes are hashed (BLAKE3) as they stream past.

    The hashing runs on one thread of its own for the whole file, in chunk order (blake3 releases
    the GIL, and spreads a large update over `threads` cores), so it overlaps the production of
    the next chunk and of the next tensor: a tensor's digest is taken on that thread after its
    last chunk, not waited for. `digests` waits for every tensor handed out so far."""

    algorithm = BLAKE3

    def __init__(self, threads: int = 1) -> None:
        self._digests: list[TensorDigest] = []
        # Half the workers: the other stages (reads, repack, scan, writes) run beside the hash on
        # their own threads, and one core hashes ~4.5 GB/s. On 2 cores blake3's thread pool would
        # only add its threads (+12 MiB RSS measured) to two cores already busy.
        self._threads = max(1, threads // 2)
        self._worker = SerialWorker(HASH_AHEAD)

    def wrap(self, chunks_for: Callable) -> Callable:
        def hashed(t) -> Iterator:
            h, n = new_hash(self.algorithm, self._threads), 0
            for chunk in chunks_for(t):
                self._worker.submit(h.update, chunk)
                n += memoryview(chunk).nbytes
                yield chunk
            self._worker.submit(self._record, t, n, h)
        return hashed

    def _record(self, t, n: int, h: Hash) -> None:
        self._digests.append(TensorDigest(t.name, t.ggml_type.name, n, h.hexdigest()))

    @property
    def digests(self) -> list[TensorDigest]:
        self._worker.drain()
        return self._digests

    def close(self) -> None:
        self._worker.close()

    def __enter__(self) -> "TensorHasher":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
