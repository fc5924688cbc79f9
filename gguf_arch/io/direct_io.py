"""Large reads and the sequential output around the page cache (O_DIRECT), with buffered fallbacks.

Why: on this project's machine a buffered write of 2 GB took 27 s and 20 CPU-seconds of kernel
time (page-cache copies and writeback), the same bytes written with O_DIRECT 2.3 s and 0.3 CPU-s
(bench/convert.py measures both each run); reading a 6.5 GB checkpoint cold in 16 MiB preads took
10.2 s and 9.1 CPU-s buffered, 7.2 s and 0.7 CPU-s with O_DIRECT. A converter streaming 1.5 TB
also has no use for the bytes in the page cache: they would only evict what is still to be read.

Reads (`pread_direct_at`): the range is widened to whole blocks and read straight to the
caller's memory, laid out so that the bytes land where it wants them; or (`pread_direct_into`) into
a buffer whose surrounding blocks are its own, straight in when its address allows, else through
this thread's scratch buffer and one copy. Small reads stay buffered (the kernel's read-ahead
serves runs of small tensors better than one device round trip each).

Writes (`SequentialWriter`): O_DIRECT wants the buffer address, the file offset and the length
aligned to the device's block. A chunk whose address is congruent to its file offset modulo
BLOCK (the converter produces its large chunks so: `buffers.placed`) has its whole blocks written
straight from its memory; the bytes at its two ends, and every other chunk, are copied into
page-aligned staging buffers (anonymous mmap) written a whole buffer at a time. Writes run on two
threads, so the disk writes while the caller fills the next buffer. The last, partial block is
padded with zeros, written, and the file is cut back to its true size. Where the file system
refuses O_DIRECT (tmpfs, some network file systems: EINVAL on the flag or on the first write) the
same writes go through the page cache.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# Above every device's logical block (512 or 4096) and a whole page, as O_DIRECT requires.
BLOCK = 4096
# Buffers of this size: one being filled, the others being written, WRITERS at a time. Measured
# on this project's machine (O_DIRECT, 3 GB): 1.55 GB/s one 8 MiB write at a time, 1.69 two at a
# time; in the converter, reads sharing the disk, one at a time kept the disk busy only 2/3 of
# the run and held the producer up for half of it.
STAGING_BYTES = 8 << 20
STAGING_BUFFERS = 3
WRITERS = 2
# Reads from this size up go around the page cache.
DIRECT_READ_MIN = 1 << 20
# Chunks from this size up are written straight from their memory when it is laid out for it
# (smaller ones are gathered in the staging buffers: fewer, larger writes).
STRAIGHT_WRITE_MIN = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none


def open_direct(fd: int, path) -> int | None:
    """A second descriptor of the file open as `fd`, reading around the page cache; None where
    the file system refuses O_DIRECT or `path` is no longer that file."""
    if not _O_DIRECT:
        return None
    try:
        direct = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(direct)
        return None
    return direct


def pread_direct_at(fd: int, addr: int, offset: int, nbytes: int, chunk: int = 0,
                    stop: Callable[[], bool] | None = None) -> int:
    """`nbytes` from `offset` of an O_DIRECT descriptor straight to memory at addr, no copy: the
    whole blocks around them are read to the whole blocks around addr, so addr must be congruent
    to offset modulo BLOCK and those blocks the caller's. In requests of at most `chunk` bytes
    (a multiple of BLOCK; 0: one), `stop()` asked before each: True ends the read there. Returns
    the bytes of the range delivered (nbytes unless stopped). EOFError(the file's size) when the
    file ends first; OSError(EINVAL) where the file system accepted the flag but refuses the
    read (the caller reads buffered instead)."""
    lead = offset % BLOCK
    if (addr - offset) % BLOCK or chunk % BLOCK:
        raise ValueError(f"address {addr:#x} is not congruent to offset {offset} modulo {BLOCK}, or chunk {chunk} "
                         "is not whole blocks")
    want = lead + nbytes
    size = -(-want // BLOCK) * BLOCK
    view = memoryview((ctypes.c_char * size).from_address(addr - lead)).cast("B")
    done = 0
    while done < want:
        if stop is not None and stop():
            return max(0, done - lead)
        n = os.preadv(fd, [view[done:done + chunk] if chunk else view[done:]], offset - lead + done)
        done += n
        if n == 0 or (done < want and done % BLOCK):  # the end of the file: a short, unaligned read
            raise EOFError(os.fstat(fd).st_size)
    return nbytes


_scratches = threading.local()


def scratch(offset: int, nbytes: int) -> int:
    """An address in this thread's block-aligned buffer, congruent to `offset` modulo BLOCK, with
    the whole blocks around `nbytes` bytes from there: for pread_direct_at when the bytes are
    copied on (the buffer is the thread's until its next call). Kept: an O_DIRECT read into
    fresh memory faults its pages in first, and measured here that took 4 readers of 2 MiB
    requests from 1.8-2.0 GB/s down to 1.1-1.4 (one reader of 8 MiB: 0.9-1.4 down to 0.4)."""
    need = nbytes + 2 * BLOCK
    buf = getattr(_scratches, "buf", None)
    if buf is None or buf.size < need:
        buf = _scratches.buf = np.empty(need + BLOCK, np.uint8)
    return buf.ctypes.data + -buf.ctypes.data % BLOCK + offset % BLOCK


def address(data) -> int:
    """The address of the first byte of a C-contiguous buffer (a read-only one too)."""
    return np.frombuffer(data, np.uint8).ctypes.data


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill `buf` (C-contiguous) from `offset` of a buffered descriptor; EOFError(the file's size)
    when the file ends first."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(os.fstat(fd).st_size)
        done += n


def pread_direct_into(fd: int, buf: np.ndarray, offset: int, room: bool = False) -> None:
    """Fill `buf` (C-contiguous) from `offset` of an O_DIRECT descriptor. With `room` (the whole
    blocks around buf are the caller's: `buffers.placed`) and an address congruent to offset
    modulo BLOCK the blocks go straight in; otherwise through this thread's scratch buffer and
    one copy. EOFError and OSError(EINVAL) as pread_direct_at."""
    addr, nbytes = buf.ctypes.data, buf.nbytes
    if room and (addr - offset) % BLOCK == 0:
        pread_direct_at(fd, addr, offset, nbytes)
        return
    at = scratch(offset, nbytes)
    pread_direct_at(fd, at, offset, nbytes)
    ctypes.memmove(addr, at, nbytes)


class SequentialWriter:
    """Writes appended bytes to `fd` from offset 0; `finish()` makes the file exactly that long."""

    def __init__(self, fd: int, staging_bytes: int = STAGING_BYTES) -> None:
        if staging_bytes % BLOCK:
            raise ValueError(f"staging buffers must be a multiple of {BLOCK} bytes, got {staging_bytes}")
        self._fd = fd
        self.direct = _set_direct(fd, True)
        self._buffers = [mmap.mmap(-1, staging_bytes) for _ in range(STAGING_BUFFERS)]
        self._pending: list[Future | None] = [None] * STAGING_BUFFERS
        self._straight: deque[Future] = deque()  # writes from the callers' chunks, at most WRITERS
        self._lock = threading.Lock()  # turning O_DIRECT off while another write is in flight
        self._current = 0
        self._fill = 0  # bytes in the current buffer
        self._flushed = 0  # file offset of the current buffer's first byte (always whole blocks)
        self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="kimi-k3-write")

    def tell(self) -> int:
        return self._flushed + self._fill

    def write(self, data) -> int:
        """Append `data` (any C-contiguous buffer); returns its length. A large chunk whose address
        is congruent to tell() modulo BLOCK has its whole blocks written from its own memory: it
        must not change until the writes are waited for (finish(), or close())."""
        view = memoryview(data).cast("B")
        head = -self.tell() % BLOCK
        body = (len(view) - head) // BLOCK * BLOCK if len(view) >= STRAIGHT_WRITE_MIN else 0
        if body <= 0 or (address(view) + head) % BLOCK:
            self._stage(view)
            return len(view)
        self._stage(view[:head])  # completes the staged block, so the staged bytes end on a block
        if self._fill:
            self._flush(self._fill)
        self._straight.append(self._pool.submit(self._pwrite, view[head:head + body], self._flushed))
        self._flushed += body
        while len(self._straight) > WRITERS:
            self._straight.popleft().result()
        self._stage(view[head + body:])
        return len(view)

    def _stage(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            buf = self._buffers[self._current]
            n = min(len(view) - done, len(buf) - self._fill)
            buf[self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            if self._fill == len(buf):
                self._flush(len(buf))

    def finish(self) -> None:
        """Write what is staged (its last block zero-padded), cut the padding off, fsync."""
        size = self.tell()
        pad = -self._fill % BLOCK
        self._buffers[self._current][self._fill:self._fill + pad] = bytes(pad)
        self._flush(self._fill + pad)
        self._wait_all()
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)

    def close(self) -> None:
        """Stop the writer threads (waiting for their writes) and free the buffers; no error raised here."""
        self._pool.shutdown(wait=True)
        self._pending = [None] * STAGING_BUFFERS
        self._straight.clear()
        for buf in self._buffers:
            try:
                buf.close()
            except BufferError:  # a failed write's traceback still views it: freed with that
                pass

    def __enter__(self) -> "SequentialWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _flush(self, nbytes: int) -> None:
        """Hand the current buffer's first `nbytes` to a writer thread; switch to the next buffer."""
        if nbytes:
            view = memoryview(self._buffers[self._current])[:nbytes]
            self._pending[self._current] = self._pool.submit(self._pwrite, view, self._flushed)
        self._flushed += self._fill
        self._fill = 0
        self._current = (self._current + 1) % STAGING_BUFFERS
        self._wait(self._current)  # its previous write must be done before it is refilled

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()

    def _wait_all(self) -> None:
        for i in range(STAGING_BUFFERS):
            self._wait(i)
        while self._straight:
            self._straight.popleft().result()

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done, buffered = 0, not self.direct
        while done < len(view):
            try:
                n = os.pwrite(self._fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or buffered:
                    raise
                with self._lock:  # accepted the flag, refuses the write: the same write, buffered
                    self.direct = self.direct and _set_direct(self._fd, False)
                buffered = True
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"short write at offset {offset + done}")
            done += n


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; returns whether it is on (False where unsupported)."""
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return on
