"""Whether a range of a file is in the page cache, asked without reading it.

Why: the converter reads large ranges around the page cache (O_DIRECT, `direct_io`), which from
a disk saves the kernel's copies, but an O_DIRECT read goes to the device even when the bytes are
cached: a checkpoint just downloaded, copied or read once would be read from the disk again. A
range that is cached whole is read through the cache instead (one copy, no I/O).

How: the file is mapped read-only and never touched through the mapping (no page is faulted in,
nothing is added to the RSS), and mincore(2) reports, per page, whether the file's page is in the
page cache. Where mapping or mincore is refused, every range counts as not cached.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Residency:
    """Page-cache residency of the file open as `fd` (its size when mapped)."""

    def __init__(self, fd: int) -> None:
        self.size = os.fstat(fd).st_size
        addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if self.size else None
        self._addr = None if addr in (None, _MAP_FAILED) else addr

    def cached(self, offset: int, nbytes: int) -> bool:
        """Every page of [offset, offset + nbytes) is in the page cache (False when unknown)."""
        if self._addr is None or nbytes <= 0 or offset < 0 or offset + nbytes > self.size:
            return False
        first = offset - offset % _PAGE
        length = offset + nbytes - first
        vec = np.empty(-(-length // _PAGE), np.uint8)
        if _libc.mincore(self._addr + first, length, vec.ctypes.data) != 0:
            return False
        return bool(np.all(vec & 1))

    def close(self) -> None:
        if self._addr is not None:
            _libc.munmap(self._addr, self.size)
            self._addr = None
