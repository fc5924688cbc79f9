"""Header-first view of a sharded safetensors checkpoint.

`model.safetensors.index.json` and the header of every shard are read and validated before any
tensor byte is touched; tensor data is then handed out as read-only numpy views of a memory map,
so a 16 GB shard is never copied into memory.

The headers are parsed here rather than by `safetensors.safe_open`: safe_open rejects a bad file
with a generic message that names neither the shard nor the tensor, cannot tell a truncated shard
from a corrupt header, and its numpy `get_tensor` returns a copy, not a view of the file. The
byte-level checks (header length within the file, offsets in range and non-overlapping, dtype x
shape == byte length) need the raw header anyway.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .jsonfile import NotRegularFile, open_regular, read_json

INDEX_FILE = "model.safetensors.index.json"
# safetensors' own limit on the JSON header; a larger length field means a corrupt file.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Shards whose pages `Checkpoint.release_pages` drops: an output tensor reads at most two shards.
RECENT_SHARDS = 2

# safetensors dtype -> numpy dtype of the stored bytes. BF16 has no numpy type: its raw
# 16-bit patterns are handed out as uint16 and widened by `to_f32`.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("?"),
}


def to_f32(dtype: str, a: np.ndarray) -> np.ndarray:
    """Exact widening to float32 (bf16 is the top half of an f32, so a 16-bit shift)."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype in ("F16", "F32"):
        return a.astype(np.float32, copy=False)
    raise CheckpointError(f"cannot read {dtype} as a float tensor")


@dataclass(frozen=True)
class TensorMeta:
    """What the converter plans with: a tensor's stored dtype and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one shard: where its bytes are."""

    name: str
    shard: str  # file name inside the model directory
    meta: TensorMeta
    start: int  # absolute byte offset in the shard file
    nbytes: int


def _check_shard_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{INDEX_FILE}: shard name must be a non-empty string, got {name!r}")
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or Path(name).is_absolute():
        raise CheckpointError(f"{INDEX_FILE}: shard name {name!r} is not a plain file name inside the "
                              "model directory (no paths, no '..')")
    return name


def read_weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name, validated."""
    path = model_dir / INDEX_FILE
    raw = read_json(path, CheckpointError, "not found (expected a sharded safetensors checkpoint)")
    wmap = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{path}: expected an object with a non-empty 'weight_map'")
    # 96 shard names, not 497k entries; a non-string value (unhashable for the set) fails in the check.
    for shard in {s if isinstance(s, str) else _check_shard_name(s) for s in wmap.values()}:
        _check_shard_name(shard)
    return wmap


def _tensor_entry(shard: str, name: str, info: object, data_start: int) -> TensorEntry:
    where = f"{shard}: tensor {name}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{where}: corrupt safetensors header entry {info!r} "
                              "(expected dtype, shape, data_offsets)")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
        raise CheckpointError(f"{where}: unsupported safetensors dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: corrupt shape {shape!r} in the safetensors header")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: corrupt data_offsets {offsets!r} in the safetensors header")
    nbytes = math.prod(shape) * NUMPY_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(f"{where}: {dtype} {shape} needs {nbytes} bytes but data_offsets "
                              f"{offsets} span {offsets[1] - offsets[0]}")
    return TensorEntry(name, shard, TensorMeta(dtype, tuple(shape)), data_start + offsets[0], nbytes)


def read_shard_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate one shard's header without reading tensor data."""
    shard = path.name
    try:
        try:
            fd = open_regular(path)
        except NotRegularFile as exc:
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} {exc}") from None
        with open(fd, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header: header length field "
                                      f"says {hlen} bytes, the file has {size - 8} after it")
            header_bytes = f.read(hlen)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} not found") from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (expected a JSON object)")
    data_start = 8 + hlen
    entries = {name: _tensor_entry(shard, name, info, data_start)
               for name, info in header.items() if name != "__metadata__"}
    _check_layout(path, size, entries.values())
    return entries


def _check_layout(path: Path, size: int, entries) -> None:
    spans = sorted((e.start, e.start + e.nbytes, e.name) for e in entries if e.nbytes)
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensors {n0} and {n1} overlap")
    if spans:
        end = max(e for _, e, _ in spans)
        if end > size:
            last = max(spans, key=lambda s: s[1])[2]
            raise CheckpointError(f"{path}: truncated: the file has {size} bytes but tensor {last} "
                                  f"ends at byte {end}")


Stamp = tuple[int, int, int]  # (inode, size, mtime ns) of a shard when its header was read


def shard_stamp(path: Path) -> Stamp:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class Checkpoint:
    """Every tensor of a sharded checkpoint: metadata from the headers, data as mmap views.

    With `stamps`, each tensor read first re-stats its shard: a shard replaced, rewritten or
    resized since its header was read (a download still running, a second copy) is refused
    instead of converted from bytes the header no longer describes.
    """

    def __init__(self, model_dir: Path, entries: dict[str, TensorEntry], stamps: dict[str, Stamp] | None = None):
        self.model_dir = model_dir
        self.entries = entries
        self.stamps = stamps or {}
        self._maps: dict[str, mmap.mmap] = {}
        self._recent: list[str] = []  # the shards read most recently, newest last

    @property
    def metas(self) -> dict[str, TensorMeta]:
        return {name: e.meta for name, e in self.entries.items()}

    def _map(self, shard: str) -> mmap.mmap:
        mm = self._maps.get(shard)
        if mm is None:
            with open(self.model_dir / shard, "rb") as f:
                mm = self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if shard in self._recent:
            self._recent.remove(shard)
        self._recent = [*self._recent[-(RECENT_SHARDS - 1):], shard]
        return mm

    def array(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's stored bytes as its numpy dtype (BF16 as uint16)."""
        e = self.entries[name]
        self._check_unchanged(e.shard)
        dt = NUMPY_DTYPES[e.meta.dtype]
        return np.frombuffer(self._map(e.shard), dtype=dt, count=e.nbytes // dt.itemsize,
                             offset=e.start).reshape(e.meta.shape)

    def _check_unchanged(self, shard: str) -> None:
        want = self.stamps.get(shard)
        if want is None:
            return
        path = self.model_dir / shard
        try:
            now = shard_stamp(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: can no longer be read ({exc.strerror}) since its header was read") from None
        if now != want:
            raise CheckpointError(f"{path}: changed since its header was read (inode, size, mtime "
                                  f"{want} -> {now}); is a download or copy still writing it?")

    def read(self, name: str) -> tuple[str, np.ndarray]:
        """(safetensors dtype, view): the reader the transforms take."""
        return self.entries[name].meta.dtype, self.array(name)

    def release_pages(self) -> None:
        """Unmap this process's resident pages of every shard; they stay in the page cache.

        Pages of a mapping read so far count in the process's RSS until unmapped, so without this
        the RSS of a conversion would grow to the size of the model. Views stay valid: a page
        touched again is faulted back in from the file. Only the recently read shards can hold
        pages: an older one was released after its last chunk, when it was still recent.
        """
        for shard in self._recent:
            self._maps[shard].madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Drop the maps; one still viewed by an array is unmapped when that array goes."""
        self._maps.clear()
        self._recent.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(model_dir: Path | str) -> Checkpoint:
    """Read the index and every shard header; every listed tensor must sit in the shard named."""
    model_dir = Path(model_dir)
    wmap = read_weight_map(model_dir)
    entries: dict[str, TensorEntry] = {}
    stamps: dict[str, Stamp] = {}
    for shard in sorted(set(wmap.values())):
        try:
            stamps[shard] = shard_stamp(model_dir / shard)  # before the header: a later change shows
        except OSError:
            pass  # read_shard_header names the problem
        for name, entry in read_shard_header(model_dir / shard).items():
            listed = wmap.get(name)
            if listed != shard:
                where = f"maps it to {listed}" if listed else "does not list it"
                raise CheckpointError(f"{model_dir / shard}: holds tensor {name} but {INDEX_FILE} {where}")
            entries[name] = entry
    absent = [n for n in wmap if n not in entries]
    if absent:
        raise CheckpointError(f"{INDEX_FILE}: tensor {absent[0]} is mapped to {wmap[absent[0]]} but that "
                              f"shard's header does not contain it ({len(absent)} such tensor(s))")
    return Checkpoint(model_dir, entries, stamps)
