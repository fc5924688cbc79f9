"""The GGUF side of the tensor diff: its tensors by name (every part of a split), read one row
range at a time, with the pages it read released as it goes (the diff's memory stays bounded)."""
from __future__ import annotations

import mmap
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..errors import GGUFError
from ..io.gguf_file import open_gguf, row_nbytes
from ..io.split_names import part_paths
from .reference import Chunk


class GGUFRows:
    """The GGUF's tensors by name, and their bytes one row range at a time. Given the first part
    of a split, every part (split_names.part_paths, as --verify and the runner read them)."""

    def __init__(self, path: Path):
        self.path = path
        first = self.reader = open_gguf(path)
        self.readers = [first] + [open_gguf(p) for p in part_paths(path, first)[1:]]
        self.tensors: dict = {}
        self._reader_of: dict = {}
        for reader in self.readers:
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"{path}: tensor {t.name!r} appears in two parts of the split")
                self.tensors[t.name], self._reader_of[t.name] = t, reader

    def rows(self, name: str, first: int, count: int) -> np.ndarray:
        t = self.tensors[name]
        row_bytes = row_nbytes(t.tensor_type, int(t.shape[0]))
        start = t.data_offset + first * row_bytes
        data = self._reader_of[name].data
        return np.asarray(data[start: start + count * row_bytes]).reshape(count, row_bytes)

    def release_pages(self) -> None:
        # np.memmap keeps its mmap.mmap as the array's base; the pages stay in the page cache.
        for reader in self.readers:
            reader.data.base.madvise(mmap.MADV_DONTNEED)


def releasing(chunks: Iterable[Chunk], gguf: GGUFRows) -> Iterator[Chunk]:
    """Pass chunks through; once one is compared, drop the pages it read from the GGUF's map.
    Without this every page read stays in the RSS: a whole-model diff would hold the GGUF (the
    checkpoint is read with pread into buffers that go with their chunk)."""
    for chunk in chunks:
        yield chunk
        gguf.release_pages()
