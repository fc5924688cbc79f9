"""The O_DIRECT sequential writer: the bytes and the size are exactly what was appended, in any
chunking, through the page cache or around it, and a refused O_DIRECT falls back cleanly."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os

import numpy as np
import pytest

from gguf_arch.io import direct_write
from gguf_arch.io.direct_write import BLOCK, SequentialWriter

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
STAGING = 4 * BLOCK  # small buffers, so every test crosses many buffer boundaries


def _chunks(seed: int, total: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out, left = [], total
    while left:
        n = int(min(left, rng.integers(0, 3 * STAGING)))
        out.append(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        left -= n
    return out


def _write(path, chunks, staging: int = STAGING) -> bool:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with SequentialWriter(fd, staging) as w:
            for c in chunks:
                assert w.write(c) == memoryview(c).nbytes
            assert w.tell() == sum(memoryview(c).nbytes for c in chunks)
            w.finish()
            return w.direct
    finally:
        os.close(fd)


@pytest.mark.parametrize("total", [0, 1, BLOCK - 1, BLOCK, STAGING, STAGING + 1, 10 * STAGING + 123])
def test_bytes_and_size_are_what_was_appended(tmp_path, total):
    chunks = _chunks(total, total)
    _write(tmp_path / "out", chunks)
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)


def test_numpy_chunks_of_any_dtype_and_shape(tmp_path):
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.uint16), b"\0" * 7]
    _write(tmp_path / "out", arrays)
    assert (tmp_path / "out").read_bytes() == b"".join(bytes(memoryview(a).cast("B")) for a in arrays)


def _resident_pages(path) -> int:
    """Pages of `path` in the page cache (mincore over a read-only mapping)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        base = np.frombuffer(m, np.uint8).ctypes.data  # the mapping's address (it is read-only)
        assert _libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)


def test_direct_output_stays_out_of_the_page_cache(tmp_path):
    """The point of O_DIRECT: a converter's output does not evict the shards still to be read."""
    chunks = _chunks(7, 64 * STAGING)
    if not _write(tmp_path / "direct", chunks):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    assert _resident_pages(tmp_path / "direct") == 0
    (tmp_path / "buffered").write_bytes(b"".join(chunks))  # control: the check sees buffered pages
    assert _resident_pages(tmp_path / "buffered") > 0


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    real, calls = os.pwrite, []

    def refusing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", refusing)
    chunks = _chunks(3, 5 * STAGING + 17)
    assert _write(tmp_path / "out", chunks) is False
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)
    assert calls[:2] == [0, 0]  # the refused write is redone, buffered


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_write.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        _write(tmp_path / "out", _chunks(5, 3 * STAGING))


def test_staging_must_be_whole_blocks(tmp_path):
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="multiple of 4096"):
            SequentialWriter(fd, BLOCK + 1)
    finally:
        os.close(fd)
