"""Streaming GGUF writer: plan first (names, types, byte sizes, order), then data in bounded chunks.

gguf-py's `GGUFWriter.add_tensor` keeps every tensor in memory until `write_tensors_to_file`, which
for a 1.5 TB checkpoint is not an option. We use its lower-level API instead: `add_tensor_info`
for each planned tensor with its final byte size, then its header, KV and tensor-info writers into
an in-memory buffer (`header_bytes`: the exact header, so the exact file size is known before a
byte is written), and then each tensor's bytes as they are produced, with the same alignment
padding gguf-py uses. Peak memory is one chunk, not one model.

The output appears only when complete: data goes to `<out>.partial` in the same directory (written
around the page cache: `direct_io`), which is fsync'd and renamed over the final name; any error or Ctrl-C removes it. Both names are claimed
through `output_paths` (never through a link, never over a file the run was not allowed to replace). The plan is a plain
value so that split output and resume can be built on it without touching the data path.
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from gguf import GGUFValueType, GGUFWriter, GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
from gguf.gguf_writer import WriterState

from ..errors import KimiError, OutputError
from ..errors.signals import checkpoint, deferred
from .atomic import removed_on_failure
from .direct_io import SequentialWriter
from .gguf_file import row_nbytes
from .gguf_values import problem as value_problem
from .output_paths import check_existing, create, partial_path
from .pipeline import SerialWorker

KV = tuple[str, Any, GGUFValueType, "GGUFValueType | None"]


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of logical numpy shape `shape`; the last dim must fill whole blocks."""
    block = GGML_QUANT_SIZES[ggml_type][0]
    if shape[-1] % block:
        raise ValueError(f"{ggml_type.name} needs the last dimension to be a multiple of {block}, got {shape}")
    return math.prod(shape[:-1]) * row_nbytes(ggml_type, shape[-1])


@dataclass(frozen=True)
class OutputTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # logical, numpy order (ggml ne reversed)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.nbytes // max(1, math.prod(self.shape[:-1])))


@dataclass(frozen=True)
class GGUFLayout:
    """Everything about the file except the tensor bytes: what a writer (or a splitter) needs.

    `arch` is None only for a split part after the first, which carries no general.architecture:
    llama-gguf-split puts every key in the first part and only the split.* keys in the others.
    """

    arch: str | None
    kv: tuple[KV, ...]
    tensors: tuple[OutputTensor, ...]


def padded(nbytes: int, alignment: int = GGUF_DEFAULT_ALIGNMENT) -> int:
    return nbytes + (-nbytes % alignment)


def _header_writer(layout: GGUFLayout) -> GGUFWriter:
    # A later split part has no architecture key: gguf-py's add_string skips the empty value.
    w = GGUFWriter(None, layout.arch or "")
    for key, value, vtype, sub_type in layout.kv:
        why = value_problem(vtype, value, sub_type)
        if why is not None:  # a derived value (a sum of two fields) can overflow what each field fit
            raise KimiError(f"GGUF key {key} {why}")
        w.add_key_value(key, value, vtype, sub_type)
    for t in layout.tensors:
        # A uint8 byte shape plus raw_dtype is gguf-py's way to declare a tensor of any type.
        w.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml_type)
    return w


def header_bytes(layout: GGUFLayout) -> bytes:
    """The file's bytes before its first tensor: header, KV, tensor infos, alignment padding."""
    w = _header_writer(layout)
    buf = io.BytesIO()
    # gguf-py writes only into files it opened itself; handing it a buffer in the state its
    # open_output_file leaves yields the same bytes without touching the disk.
    w.fout, w.state = [buf], WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    _pad(buf, w.data_alignment)
    return buf.getvalue()


def file_size(layout: GGUFLayout) -> int:
    """Exact size of the file `write_gguf` writes for `layout`."""
    return len(header_bytes(layout)) + sum(padded(t.nbytes) for t in layout.tensors)


def tensor_offsets(layout: GGUFLayout, size: int) -> dict[str, int]:
    """Each tensor's offset in the file `write_gguf` writes for `layout` (`size`: its file_size;
    the tensors' data, each padded to the alignment, ends the file)."""
    at = size - sum(padded(t.nbytes) for t in layout.tensors)
    offsets = {}
    for t in layout.tensors:
        offsets[t.name] = at
        at += padded(t.nbytes)
    return offsets


def _pad(fout, alignment: int) -> None:
    fout.write(b"\0" * (-fout.tell() % alignment))


# Chunks handed to the writer thread and not yet written (at most 2 x 64 MiB, mostly page-cache views).
WRITE_AHEAD = 2


def _write_data(fout, layout: GGUFLayout, alignment: int, chunks_for: Callable[[OutputTensor], Iterable]) -> None:
    """Tensor bytes in layout order, each padded to `alignment` (the header already is).

    The writes run on a thread of their own (a large write releases the GIL), so the next chunk is
    produced (repacked, hashed, faulted in from the shard) while the previous one is copied out.
    """
    with SerialWorker(WRITE_AHEAD) as writer:
        for t in layout.tensors:
            written = 0
            for chunk in chunks_for(t):
                checkpoint()  # a stop signal is raised here, between two chunks (signals.deferred)
                writer.submit(fout.write, chunk)
                written += memoryview(chunk).nbytes
            if written != t.nbytes:
                raise ValueError(f"{t.name}: produced {written} bytes, planned {t.nbytes}")
            writer.submit(fout.write, b"\0" * (-t.nbytes % alignment))
        writer.drain()


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_gguf(out: Path, layout: GGUFLayout, chunks_for: Callable[[OutputTensor], Iterable],
               overwrite: bool = False) -> None:
    """Write `layout` to `out`, pulling each tensor's bytes from `chunks_for` in layout order."""
    out = Path(out)
    check_existing(out, overwrite)
    tmp = partial_path(out)
    header = header_bytes(layout)
    try:
        fout = create(tmp, overwrite)  # never through a link planted at the partial name
    except OSError as exc:
        raise OutputError(f"writing {out} failed: {exc}") from None
    # The main thread waits on the reader, writer and hasher threads here: a stop signal raised
    # inside threading's own code would break a lock, so it waits for the next chunk (deferred).
    with removed_on_failure(tmp, out), deferred():
        with fout, SequentialWriter(fout.fileno()) as w:
            w.write(header)
            _write_data(w, layout, GGUF_DEFAULT_ALIGNMENT, chunks_for)
            w.finish()
        check_existing(out, overwrite)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
