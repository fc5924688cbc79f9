"""The converter's buffers reused by malloc instead of handed back to the kernel and zero-filled again.

Why: the converter allocates and frees buffers of megabytes per chunk (reads, repacked experts,
whole small tensors). glibc's malloc hands some freed blocks back to the kernel (every block above
its mmap threshold, which it raises by itself only up to 32 MiB; a heap's free top past its trim
threshold), and the next allocation faults every page in again, each zero-filled by the kernel:
converting the 9.1 GB bench checkpoint took 84,000-91,000 page faults and 3.0-3.3 CPU-s of kernel
time, 23,000 faults and 2.1-2.3 CPU-s with the settings below (measured here, -j 1). Keeping
them costs nothing the peak RSS does not already hold: the blocks kept are the ones in flight a
moment before.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap, so a freed one is reused: above every buffer the
# converter allocates (16 MiB chunks, 6 MB experts).
MMAP_THRESHOLD = 64 << 20
# A heap's free top is returned to the kernel only past this: above the converter's peak RSS.
TRIM_THRESHOLD = 1 << 30


def keep_freed_buffers() -> bool:
    """Set malloc to reuse freed large blocks (glibc only); whether it was set."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: its own policy stays
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
