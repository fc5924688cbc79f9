"""Header-first view of a sharded safetensors checkpoint.

`model.safetensors.index.json` and the header of every shard are read and validated before any
tensor byte is touched; tensor data is then read with pread into bounded buffers (`Checkpoint`),
so a 16 GB shard is never held in memory and a shard truncated under the reader is an error.

The headers are parsed here rather than by `safetensors.safe_open`: safe_open rejects a bad file
with a generic message that names neither the shard nor the tensor, cannot tell a truncated shard
from a corrupt header, and memory-maps the file. The
byte-level checks (header length within the file, offsets in range and non-overlapping, dtype x
shape == byte length) need the raw header anyway.
"""
from __future__ import annotations

import errno
import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .direct_io import DIRECT_READ_MIN, open_direct, pread_direct
from .jsonfile import NotRegularFile, open_regular, read_json
from .pipeline import ahead
from .residency import Residency

INDEX_FILE = "model.safetensors.index.json"
# safetensors' own limit on the JSON header; a larger length field means a corrupt file.
MAX_HEADER_BYTES = 100 * 1024 * 1024

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


# Tensors up to this size are read whole; larger ones come as a `ShardArray` read in row ranges
# (the size of the transforms' chunks: see CHUNK_BYTES there).
WHOLE_BYTES = 16 << 20


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill `buf` from `offset`; EOFError(the file's size) when the file ends first."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(os.fstat(fd).st_size)
        done += n


class ShardArray:
    """A large tensor not yet read: its shape and dtype, and its bytes read on demand, a range of
    leading-axis rows at a time (`a[i:j]`), through pread into a fresh buffer. `reshape` gives
    another view of the same bytes; anything else (`np.asarray(a)`) reads it whole."""

    def __init__(self, ckpt: "Checkpoint", entry: TensorEntry, shape: tuple[int, ...]) -> None:
        self._ckpt, self._entry = ckpt, entry
        self.shape = shape
        self.dtype = NUMPY_DTYPES[entry.meta.dtype]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape) -> "ShardArray":
        shape = tuple(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return ShardArray(self._ckpt, self._entry, shape)

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            return np.asarray(self)[index]
        start, stop, _ = index.indices(self.shape[0])
        row = self.size // max(1, self.shape[0]) if self.shape[0] else 0
        return self._ckpt.read_range(self._entry, start * row, max(0, stop - start) * row).reshape(
            (max(0, stop - start), *self.shape[1:]))

    def flat_chunks(self, step: int):
        """The values in C order, `step` elements at a time; with the checkpoint's `read_ahead`
        above 1, that many preads are in flight on threads (pread releases the GIL), so the disk
        sees a queue instead of one request at a time while the caller hashes and writes."""
        def read(start: int) -> np.ndarray:
            return self._ckpt.read_range(self._entry, start, min(step, self.size - start))
        starts = range(0, self.size, step)
        depth = self._ckpt.read_ahead
        return ahead(read, starts, depth) if depth > 1 else map(read, starts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self._ckpt.read_range(self._entry, 0, self.size).reshape(self.shape)
        return a if dtype is None else a.astype(dtype)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return np.asarray(self).astype(dtype, copy=copy)


class Checkpoint:
    """Every tensor of a sharded checkpoint: metadata from the headers, data read with pread.

    Not memory-mapped: a shard truncated while it is read (a second copy, a failing disk) would
    end a mapped read with SIGBUS; pread returns short and the read is a CheckpointError naming
    the shard. Memory stays bounded: a tensor up to WHOLE_BYTES is read whole, a larger one
    (the embeddings, the big projections) is a `ShardArray` its consumer reads in row ranges.
    Reads from DIRECT_READ_MIN up go around the page cache (O_DIRECT), except a range the cache
    holds whole, read through it (`residency`: a mapping only asked about, never read through,
    so it cannot fault either).

    With `stamps`, each tensor read first re-stats its shard: a shard replaced, rewritten or
    resized since its header was read (a download still running, a second copy) is refused
    instead of converted from bytes the header no longer describes.
    """

    def __init__(self, model_dir: Path, entries: dict[str, TensorEntry], stamps: dict[str, Stamp] | None = None,
                 read_ahead: int = 1):
        self.model_dir = model_dir
        self.read_ahead = read_ahead  # chunk reads of one large tensor in flight at once
        self.entries = entries
        self.stamps = stamps or {}
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}  # the same shards read around the page cache
        self._residency: dict[str, Residency] = {}  # which of their ranges are cached: read through it
        self._opening = threading.RLock()

    @property
    def metas(self) -> dict[str, TensorMeta]:
        return {name: e.meta for name, e in self.entries.items()}

    def _fd(self, shard: str) -> int:
        with self._opening:
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = open_regular(self.model_dir / shard)
            return fd

    def _direct_fd(self, shard: str, offset: int, nbytes: int) -> int | None:
        """The O_DIRECT descriptor for a large read, None for a small one or one the page cache
        holds whole (`residency`: O_DIRECT would read those bytes from the device again)."""
        if nbytes < DIRECT_READ_MIN:
            return None
        with self._opening:  # reads in flight on several threads may ask for a new shard at once
            if shard not in self._residency:
                self._direct_fds[shard] = open_direct(self._fd(shard), self.model_dir / shard)
                self._residency[shard] = Residency(self._fd(shard))
            direct, residency = self._direct_fds[shard], self._residency[shard]
        return None if direct is None or residency.cached(offset, nbytes) else direct

    def read_range(self, e: TensorEntry, first: int, count: int) -> np.ndarray:
        """Elements [first, first + count) of the tensor, flat, in a new read-only array; a short
        read is a truncated shard (a CheckpointError), never a SIGBUS."""
        dt = NUMPY_DTYPES[e.meta.dtype]
        offset = e.start + first * dt.itemsize
        try:
            buf = self._read(e.shard, offset, count, dt)
        except EOFError as end:
            want = self.stamps.get(e.shard)
            raise CheckpointError(f"{self.model_dir / e.shard}: tensor {e.name}: the shard ends at byte "
                                  f"{end.args[0]}, its header said {want[1] if want else -1} bytes "
                                  "(truncated while it was being read?)") from None
        buf.flags.writeable = False
        return buf

    def _read(self, shard: str, offset: int, count: int, dt: np.dtype) -> np.ndarray:
        direct = self._direct_fd(shard, offset, count * dt.itemsize)
        if direct is not None:
            try:
                return np.frombuffer(pread_direct(direct, offset, count * dt.itemsize), dt)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                with self._opening:  # accepted the flag, refuses the read: buffered from now on
                    if self._direct_fds.get(shard) == direct:  # not already closed by another reader
                        self._direct_fds[shard] = None
                        os.close(direct)
        buf = np.empty(count, dtype=dt)
        _pread_into(self._fd(shard), buf, offset)
        return buf

    def array(self, name: str) -> np.ndarray | ShardArray:
        """The tensor's stored values as its numpy dtype (BF16 as uint16): read now when small."""
        e = self.entries[name]
        self._check_unchanged(e.shard)
        if e.nbytes <= WHOLE_BYTES:
            return self.read_range(e, 0, e.nbytes // NUMPY_DTYPES[e.meta.dtype].itemsize).reshape(e.meta.shape)
        return ShardArray(self, e, e.meta.shape)

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

    def read(self, name: str) -> tuple[str, np.ndarray | ShardArray]:
        """(safetensors dtype, values): the reader the transforms take."""
        return self.entries[name].meta.dtype, self.array(name)

    def close(self) -> None:
        for residency in self._residency.values():
            residency.close()
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._direct_fds.clear()
        self._residency.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(model_dir: Path | str, read_ahead: int = 1) -> Checkpoint:
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
    return Checkpoint(model_dir, entries, stamps, read_ahead)
