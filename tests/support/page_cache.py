"""What of a file is in the page cache: for tests of the reads and writes that must go around it."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def resident_pages(path: Path, start: int = 0, nbytes: int | None = None) -> int:
    """Pages of bytes [start, start + nbytes) of `path` in the page cache (mincore of a mapping)."""
    size = os.path.getsize(path)
    nbytes = size - start if nbytes is None else nbytes
    first = start - start % mmap.PAGESIZE
    length = start + nbytes - first
    with open(path, "rb") as f, mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ, offset=first) as m:
        vec = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
        base = np.frombuffer(m, np.uint8).ctypes.data  # the mapping's address (it is read-only)
        assert _libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)


def evict_pages(path: Path) -> None:
    """Drop the file's clean pages from the page cache (what the tests then read must come from disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_pages(path) == 0, f"{path}: pages stayed in the page cache"
