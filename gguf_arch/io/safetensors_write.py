"""A streaming safetensors writer: one tensor's bytes at a time, never a whole shard in memory.

The `safetensors` package only serializes a complete dict of in-memory tensors, so a multi-GB
shard would have to be materialized first. The format is simple enough to write directly:
an 8-byte little-endian header length, a JSON header (`__metadata__` first, then every tensor
with dtype, shape and `data_offsets` relative to the data section) padded with spaces to a
multiple of 8, then the tensor bytes back to back. Tensors are laid out in the order the
`safetensors` library itself uses (larger dtype first, then by name), so a file written here is
byte-identical to `safetensors.torch.save_file` of the same tensors.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Iterable

from .output_paths import create
from .safetensors import NUMPY_DTYPES

# safetensors orders tensors by its Dtype enum, descending; these are the dtypes a Kimi K3
# checkpoint uses, in that enum's order.
_DTYPE_ORDER = ("U8", "F16", "BF16", "F32")

Chunks = Callable[[], Iterable[memoryview | bytes]]


@dataclass(frozen=True)
class StreamedTensor:
    """A tensor whose bytes are produced on demand, in row-major order, in any chunk sizes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Chunks

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * NUMPY_DTYPES[self.dtype].itemsize


def file_order(tensors: Iterable[StreamedTensor]) -> list[StreamedTensor]:
    """The order safetensors writes tensors in: dtype descending, then name."""
    return sorted(tensors, key=lambda t: (-_DTYPE_ORDER.index(t.dtype), t.name))


def header_bytes(ordered: list[StreamedTensor], metadata: dict[str, str]) -> bytes:
    """Length prefix plus the space-padded JSON header for tensors already in file order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in ordered:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, tensors: Iterable[StreamedTensor], metadata: dict[str, str]) -> int:
    """Write one safetensors file, streaming each tensor's chunks; returns the data bytes written.
    A file or link already at `path` is replaced, never written through (the caller decided that
    the directory is its own)."""
    ordered = file_order(tensors)
    total = 0
    with create(path, replace=True) as f:
        f.write(header_bytes(ordered, metadata))
        for t in ordered:
            written = sum(f.write(chunk) for chunk in t.chunks())
            if written != t.nbytes:
                raise ValueError(f"{path}: tensor {t.name} produced {written} bytes, its header says {t.nbytes}")
            total += written
    return total
