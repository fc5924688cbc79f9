"""Per-tensor SHA-256 manifest of a converted GGUF: written beside it, read back, checked.

Design: a sidecar manifest `<out>.sha256.json`, not a metadata key. The GGUF header (keys and
tensor infos) is written before the first tensor byte, so a digest of the data could only go into
it by a second pass over 1.5 TB or by seeking back into a reserved header slot, which would tie
the writer's byte layout to this module. Instead each chunk the writer streams out is also fed to
that tensor's SHA-256 (`TensorHasher`): the data is still written once, in one pass, from bounded
chunks. After the GGUF has been renamed into place, the manifest is written next to it the same
way the GGUF is (`<manifest>.partial`, fsync, rename), so it too appears only when complete.

It records the GGUF's size, the SHA-256 of its header bytes (everything before the first tensor's
data, read back once: megabytes, not the model) and, in file order, every tensor's name, GGML type,
byte count and SHA-256. A process killed between the two renames leaves a GGUF with no manifest
(or the previous run's, with --overwrite): `--verify` then fails loudly, never passes silently.

`check_hashes` compares a GGUF with its manifest (cheap, catches bit rot and truncation); the
verifier (`gguf_arch.verify.verify`) runs it before it recomputes every tensor from the checkpoint.
Memory stays bounded: tensor bytes are hashed from 16 MiB reads.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from ..errors import EXIT_RUNTIME, KimiError, OutputError
from .gguf_file import open_gguf
from .jsonfile import read_json
from .output_paths import create, manifest_path, partial_path
from .pipeline import SerialWorker

MANIFEST_FORMAT = "kimi-k3-gguf-sha256/1"
_READ_BYTES = 16 << 20
_HEX = frozenset("0123456789abcdef")


class IntegrityError(KimiError):
    """The GGUF differs from its manifest or from the checkpoint (exit 1, like cmp)."""

    exit_code = EXIT_RUNTIME


@dataclass(frozen=True)
class TensorDigest:
    name: str
    ggml_type: str
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    gguf_size: int
    header_sha256: str
    tensors: tuple[TensorDigest, ...]


# Chunks handed to the hashing thread and not yet hashed (bounded, like the writer's queue).
HASH_AHEAD = 2


class TensorHasher:
    """Wraps the writer's `chunks_for` so each tensor's bytes are hashed as they stream past.

    SHA-256 runs on one thread of its own for the whole file (hashlib releases the GIL on large
    buffers), in chunk order, so hashing overlaps the production of the next chunk, and of the
    next tensor: a tensor's digest is taken on that thread after its last chunk, not waited for.
    `digests` waits for every tensor handed out so far."""

    def __init__(self) -> None:
        self._digests: list[TensorDigest] = []
        self._worker = SerialWorker(HASH_AHEAD)

    def wrap(self, chunks_for: Callable) -> Callable:
        def hashed(t) -> Iterator:
            h, n = hashlib.sha256(), 0
            for chunk in chunks_for(t):
                self._worker.submit(h.update, chunk)
                n += memoryview(chunk).nbytes
                yield chunk
            self._worker.submit(self._record, t, n, h)
        return hashed

    def _record(self, t, n: int, h) -> None:
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


def _data_start(reader: GGUFReader) -> int:
    return min((t.data_offset for t in reader.tensors), default=int(reader.data.nbytes))


def _sha256_of_range(path: Path, start: int, nbytes: int) -> str:
    """Plain reads, not the memory map: hashing 1.5 TB must not map it all into the RSS."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while nbytes:
            block = f.read(min(nbytes, _READ_BYTES))
            if not block:
                raise IntegrityError(f"{path}: ends before byte {start} + {nbytes} (truncated)")
            h.update(block)
            nbytes -= len(block)
    return h.hexdigest()


def write_manifest(gguf: Path | str, digests: Iterable[TensorDigest], replace: bool = False) -> Path:
    """Write `<gguf>.sha256.json` atomically; the header digest is read back from the GGUF.
    `replace`: a leftover partial manifest may be replaced (its name was claimed by the run)."""
    gguf = Path(gguf)
    start = _data_start(open_gguf(gguf))
    doc = {"format": MANIFEST_FORMAT, "gguf": gguf.name, "gguf_size": gguf.stat().st_size,
           "header_sha256": _sha256_of_range(gguf, 0, start),
           "tensors": [[d.name, d.ggml_type, d.nbytes, d.sha256] for d in digests]}
    path = manifest_path(gguf)
    tmp = partial_path(path)
    try:
        with create(tmp, replace, "w") as f:
            json.dump(doc, f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"writing {path} failed: {exc}") from None
    return path


def _is_digest(x: object) -> bool:
    return isinstance(x, str) and len(x) == 64 and set(x) <= _HEX


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _digest_entry(path: Path, i: int, row: object) -> TensorDigest:
    if (not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], str)
            or row[1] not in Q.__members__ or not _is_count(row[2]) or not _is_digest(row[3])):
        raise IntegrityError(f"{path}: tensors[{i}] must be [name, GGML type, byte count, sha256 hex], "
                             f"got {str(row)[:120]}")
    return TensorDigest(*row)


def read_manifest(gguf: Path | str) -> Manifest:
    """The manifest next to `gguf`, strictly validated (it is input like any other file)."""
    path = manifest_path(gguf)
    doc = read_json(path, IntegrityError, "no integrity manifest next to the GGUF (not written by this converter, "
                    "or the conversion was interrupted before it was written)", invalid="unreadable integrity manifest")
    if (not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not _is_count(doc.get("gguf_size"))
            or not _is_digest(doc.get("header_sha256")) or not isinstance(doc.get("tensors"), list)):
        raise IntegrityError(f"{path}: not a {MANIFEST_FORMAT} manifest (expected format, gguf_size, "
                             "header_sha256 and tensors)")
    tensors = tuple(_digest_entry(path, i, row) for i, row in enumerate(doc["tensors"]))
    return Manifest(doc["gguf_size"], doc["header_sha256"], tensors)


def check_hashes(gguf: Path | str, manifest: Manifest, advance: Callable[[int], object] = lambda _n: None) -> None:
    """Raise IntegrityError at the first byte-level difference between the GGUF and its manifest;
    `advance(n)` after each tensor's n bytes are hashed."""
    gguf = Path(gguf)
    size = gguf.stat().st_size
    if size != manifest.gguf_size:
        raise IntegrityError(f"{gguf}: {size} bytes, the manifest says {manifest.gguf_size} (truncated or replaced)")
    reader = open_gguf(gguf)
    start = _data_start(reader)
    if _sha256_of_range(gguf, 0, start) != manifest.header_sha256:
        raise IntegrityError(f"{gguf}: header (metadata or tensor infos) differs from the manifest's digest")
    advance(start)
    found = [(t.name, Q(t.tensor_type).name, int(t.n_bytes), int(t.data_offset)) for t in reader.tensors]
    listed = [(d.name, d.ggml_type, d.nbytes) for d in manifest.tensors]
    if [f[:3] for f in found] != listed:
        first = next((i for i, (f, m) in enumerate(zip(found, listed)) if f[:3] != m), min(len(found), len(listed)))
        raise IntegrityError(f"{gguf}: tensor #{first} is {found[first][:3] if first < len(found) else 'absent'}, "
                             f"the manifest lists {listed[first] if first < len(listed) else 'nothing'}")
    for (name, _type, nbytes, offset), d in zip(found, manifest.tensors):
        if _sha256_of_range(gguf, offset, nbytes) != d.sha256:
            raise IntegrityError(f"{gguf}: tensor {name}: SHA-256 differs from the manifest (corrupted bytes)")
        advance(nbytes)
