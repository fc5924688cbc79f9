"""Per-tensor integrity manifest of a GGUF file: written beside it, read back, checked.

Any GGUF this project writes (a converted model, each part of a split, a pruned model, a vision
projector) gets the same manifest under the same name, `<file>.manifest.json`: nothing here
depends on what the GGUF holds. It records the file's size, the digest of its header bytes
(everything before the first tensor's data, read back once: megabytes, not the model) and, in
file order, every tensor's name, GGML type, byte count and digest.

Format (version 2): {"format": "kimi-k3-gguf-manifest", "version": 2, "hash": "blake3",
"gguf", "gguf_size", "header", "tensors": [[name, type, bytes, hex digest], ...]}. Version 1
(`"format": "kimi-k3-gguf-sha256/1"`, `header_sha256`, SHA-256 digests, named
`<file>.sha256.json`) is what converters before BLAKE3 wrote: it is still read and checked, and
found under its own name when no `<file>.manifest.json` is there. Writing a manifest removes a
version-1 one left beside the same file, so one file never has two.

Design: a sidecar file, not a metadata key. The GGUF header (keys and tensor infos) is written
before the first tensor byte, so a digest of the data could only go into it by a second pass over
1.5 TB or by seeking back into a reserved header slot, which would tie the writer's byte layout to
this module. Instead each chunk the writer streams out is also fed to that tensor's hash
(`digests.TensorHasher`): the data is still written once, in one pass, from bounded chunks. After
the GGUF has been renamed into place, the manifest is written next to it the same way the GGUF is
(`<manifest>.partial`, fsync, rename), so it too appears only when complete. A process killed
between the two renames leaves a GGUF with no manifest (or the previous run's, with --overwrite):
`--verify` then fails loudly, never passes silently.

`check_hashes` compares a GGUF with its manifest (cheap, catches bit rot and truncation); the
verifier (`gguf_arch.verify.verify`) runs it before it recomputes every tensor from the checkpoint.
Memory stays bounded: tensor bytes are hashed from 16 MiB reads.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from ..errors import EXIT_RUNTIME, KimiError, OutputError
from .digests import BLAKE3, HEX_DIGITS, SHA256, TensorDigest, TensorHasher, TruncatedError, hash_range
from .gguf_file import open_gguf
from .jsonfile import read_json
from .output_paths import create, legacy_manifest_path, manifest_path, partial_path

__all__ = ["IntegrityError", "Manifest", "TensorDigest", "TensorHasher", "check_hashes", "found_manifest_path",
           "manifest_path", "read_manifest", "write_manifest"]

MANIFEST_FORMAT = "kimi-k3-gguf-manifest"
MANIFEST_VERSION = 2
LEGACY_FORMAT = "kimi-k3-gguf-sha256/1"  # version 1: SHA-256, header_sha256
_HEX = frozenset("0123456789abcdef")


class IntegrityError(KimiError):
    """The GGUF differs from its manifest or from the checkpoint (exit 1, like cmp)."""

    exit_code = EXIT_RUNTIME


@dataclass(frozen=True)
class Manifest:
    hash: str  # BLAKE3 or SHA256: what every digest of this manifest is
    gguf_size: int
    header: str  # digest of the bytes before the first tensor's data
    tensors: tuple[TensorDigest, ...]


def _data_start(reader: GGUFReader) -> int:
    return min((t.data_offset for t in reader.tensors), default=int(reader.data.nbytes))


def _digest_of_range(hash_name: str, path: Path, start: int, nbytes: int, threads: int = 1) -> str:
    try:
        return hash_range(hash_name, path, start, nbytes, threads)
    except TruncatedError as exc:
        raise IntegrityError(str(exc)) from None


def write_manifest(gguf: Path | str, digests: Iterable[TensorDigest], replace: bool = False) -> Path:
    """Write `<gguf>.manifest.json` atomically (BLAKE3 digests, as TensorHasher takes them); the
    header digest is read back from the GGUF. `replace`: a leftover partial manifest may be
    replaced (its name was claimed by the run), and a version-1 manifest beside it is removed."""
    gguf = Path(gguf)
    start = _data_start(open_gguf(gguf))
    doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "hash": TensorHasher.algorithm,
           "gguf": gguf.name, "gguf_size": gguf.stat().st_size,
           "header": _digest_of_range(TensorHasher.algorithm, gguf, 0, start),
           "tensors": [[d.name, d.ggml_type, d.nbytes, d.digest] for d in digests]}
    path = manifest_path(gguf)
    tmp = partial_path(path)
    try:
        with create(tmp, replace, "w") as f:
            json.dump(doc, f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if replace:  # it described an earlier file of this name
            legacy_manifest_path(gguf).unlink(missing_ok=True)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"writing {path} failed: {exc}") from None
    return path


def found_manifest_path(gguf: Path | str) -> Path:
    """Where the manifest of `gguf` is read from: `<gguf>.manifest.json`, or a version-1
    `<gguf>.sha256.json` when only that one exists."""
    path, legacy = manifest_path(gguf), legacy_manifest_path(gguf)
    return legacy if not os.path.lexists(path) and os.path.lexists(legacy) else path


def _is_digest(x: object) -> bool:
    return isinstance(x, str) and len(x) == HEX_DIGITS and set(x) <= _HEX


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _digest_entry(path: Path, i: int, row: object, hash_name: str) -> TensorDigest:
    if (not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], str)
            or row[1] not in Q.__members__ or not _is_count(row[2]) or not _is_digest(row[3])):
        raise IntegrityError(f"{path}: tensors[{i}] must be [name, GGML type, byte count, {hash_name} hex], "
                             f"got {str(row)[:120]}")
    return TensorDigest(*row)


def _hash_and_header(path: Path, doc: object) -> tuple[str, object]:
    """(hash name, header digest) of a version-2 or a version-1 manifest document."""
    if isinstance(doc, dict) and doc.get("format") == LEGACY_FORMAT:
        return SHA256, doc.get("header_sha256")
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise IntegrityError(f"{path}: not a {MANIFEST_FORMAT} manifest (no \"format\": \"{MANIFEST_FORMAT}\")")
    if doc.get("version") != MANIFEST_VERSION or doc.get("hash") != BLAKE3:
        raise IntegrityError(f"{path}: manifest version {doc.get('version')!r} with hash {doc.get('hash')!r}; "
                             f"this version reads version {MANIFEST_VERSION} ({BLAKE3}) and 1 ({SHA256})")
    return BLAKE3, doc.get("header")


def read_manifest(gguf: Path | str) -> Manifest:
    """The manifest next to `gguf` (`found_manifest_path`), strictly validated (it is input like
    any other file); version 2 or version 1."""
    path = found_manifest_path(gguf)
    doc = read_json(path, IntegrityError, "no integrity manifest next to the GGUF (not written by this converter, "
                    "or the conversion was interrupted before it was written)", invalid="unreadable integrity manifest")
    hash_name, header = _hash_and_header(path, doc)
    if not _is_count(doc.get("gguf_size")) or not _is_digest(header) or not isinstance(doc.get("tensors"), list):
        raise IntegrityError(f"{path}: not a complete {hash_name} manifest (expected gguf_size, the header's "
                             "digest and tensors)")
    tensors = tuple(_digest_entry(path, i, row, hash_name) for i, row in enumerate(doc["tensors"]))
    return Manifest(hash_name, doc["gguf_size"], header, tensors)


def check_hashes(gguf: Path | str, manifest: Manifest, advance: Callable[[int], object] = lambda _n: None,
                 threads: int = 1) -> None:
    """Raise IntegrityError at the first byte-level difference between the GGUF and its manifest;
    `advance(n)` after each tensor's n bytes are hashed; BLAKE3 may use `threads` cores."""
    gguf = Path(gguf)
    size = gguf.stat().st_size
    if size != manifest.gguf_size:
        raise IntegrityError(f"{gguf}: {size} bytes, the manifest says {manifest.gguf_size} (truncated or replaced)")
    reader = open_gguf(gguf)
    start = _data_start(reader)
    if _digest_of_range(manifest.hash, gguf, 0, start) != manifest.header:
        raise IntegrityError(f"{gguf}: header (metadata or tensor infos) differs from the manifest's digest")
    advance(start)
    found = [(t.name, Q(t.tensor_type).name, int(t.n_bytes), int(t.data_offset)) for t in reader.tensors]
    listed = [(d.name, d.ggml_type, d.nbytes) for d in manifest.tensors]
    if [f[:3] for f in found] != listed:
        first = next((i for i, (f, m) in enumerate(zip(found, listed)) if f[:3] != m), min(len(found), len(listed)))
        raise IntegrityError(f"{gguf}: tensor #{first} is {found[first][:3] if first < len(found) else 'absent'}, "
                             f"the manifest lists {listed[first] if first < len(listed) else 'nothing'}")
    for (name, _type, nbytes, offset), d in zip(found, manifest.tensors):
        if _digest_of_range(manifest.hash, gguf, offset, nbytes, threads) != d.digest:
            raise IntegrityError(f"{gguf}: tensor {name}: {manifest.hash.upper()} digest differs from the manifest "
                                 "(corrupted bytes)")
        advance(nbytes)
