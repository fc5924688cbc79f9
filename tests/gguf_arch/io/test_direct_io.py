"""O_DIRECT reads and the sequential writer: the bytes (and the written size) are exactly the
file's / what was appended, at any offset and chunking, whether a chunk is laid out for its file
offset (its whole blocks written from its own memory) or copied, and a refused O_DIRECT falls
back cleanly."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from gguf_arch.io import direct_io
from gguf_arch.io.buffers import placed
from gguf_arch.io.direct_io import BLOCK, SequentialWriter, open_direct, pread_direct_into

from tests.support.page_cache import evict_pages, resident_pages

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


def test_direct_output_stays_out_of_the_page_cache(tmp_path):
    """The point of O_DIRECT: a converter's output does not evict the shards still to be read."""
    chunks = _chunks(7, 64 * STAGING)
    if not _write(tmp_path / "direct", chunks):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    assert resident_pages(tmp_path / "direct") == 0
    (tmp_path / "buffered").write_bytes(b"".join(chunks))  # control: the check sees buffered pages
    assert resident_pages(tmp_path / "buffered") > 0


def test_a_refused_direct_io_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    real, calls = os.pwrite, []

    def refusing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refusing)
    chunks = _chunks(3, 5 * STAGING + 17)
    assert _write(tmp_path / "out", chunks) is False
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)
    assert calls[0] == 0 and calls.count(0) == 2  # the refused write is redone, buffered (writes overlap)


def _staged_bytes(monkeypatch) -> list[int]:
    """Records the length of every copy into the writer's staging buffers."""
    real, staged = SequentialWriter._stage, []

    def counting(self, view):
        staged.append(len(view))
        return real(self, view)
    monkeypatch.setattr(SequentialWriter, "_stage", counting)
    return staged


@pytest.mark.parametrize("refuse", [False, True], ids=["direct", "refused"])
def test_chunks_laid_out_for_their_offset_are_written_from_their_own_memory(tmp_path, monkeypatch, refuse):
    """A large chunk at an address congruent to its file offset has its whole blocks written
    straight from it: only its two ends (under a block each) are copied; a chunk laid out for
    another offset, and small chunks, are copied whole. The file is the bytes appended either way,
    through O_DIRECT or after the file system refused it."""
    monkeypatch.setattr(direct_io, "STRAIGHT_WRITE_MIN", 2 * BLOCK)
    if refuse:
        monkeypatch.setattr(direct_io, "_set_direct", lambda fd, on: False)
    staged = _staged_bytes(monkeypatch)
    rng = np.random.default_rng(11)
    chunks, at, copied, laid_out = [], 0, 0, 0
    for i in range(40):
        n = int(rng.integers(1, 6 * BLOCK))
        misplaced = i % 5 == 4
        buf = placed(n, at + (100 if misplaced else 0))
        buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
        chunks.append(buf)
        if n < 2 * BLOCK or misplaced:
            copied += n
        else:
            laid_out += 1
        at += n
    path = tmp_path / "out"
    direct = _write(path, chunks)
    assert not (refuse and direct)
    if direct:
        assert resident_pages(path) == 0  # asked before the check below reads the file
    assert path.read_bytes() == b"".join(c.tobytes() for c in chunks)
    assert laid_out > 10 and copied <= sum(staged) <= copied + 2 * BLOCK * laid_out


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        _write(tmp_path / "out", _chunks(5, 3 * STAGING))


def test_staging_must_be_whole_blocks(tmp_path):
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="multiple of 4096"):
            SequentialWriter(fd, BLOCK + 1)
    finally:
        os.close(fd)


@pytest.fixture
def direct_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 * BLOCK + 777, dtype=np.uint8).tobytes()
    path = tmp_path / "data"
    path.write_bytes(data)
    evict_pages(path)
    fd = os.open(path, os.O_RDONLY)
    direct = open_direct(fd, path)
    if direct is None:
        os.close(fd)
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    yield data, direct, path
    os.close(direct)
    os.close(fd)


def _into(direct: int, offset: int, nbytes: int, layout: str) -> bytes:
    """pread_direct_into a buffer laid out for `offset` (read straight in) or one that is not
    (read through the scratch buffer), `layout` says which."""
    buf = placed(nbytes, offset if layout == "straight" else offset + 512)
    pread_direct_into(direct, buf, offset, room=True)
    return buf.tobytes()


@pytest.mark.parametrize("layout", ["straight", "scratch"])
@pytest.mark.parametrize("offset,nbytes", [(0, 1), (1, BLOCK), (BLOCK - 1, 2), (BLOCK, BLOCK), (123, 3 * BLOCK + 5),
                                           (5 * BLOCK + 700, 77), (0, 5 * BLOCK + 777), (17, 0)])
def test_direct_reads_return_the_files_bytes_at_any_offset(direct_file, offset, nbytes, layout):
    data, direct, path = direct_file
    assert _into(direct, offset, nbytes, layout) == data[offset:offset + nbytes]
    assert resident_pages(path) == 0


@pytest.mark.parametrize("offset,nbytes", [(0, 5 * BLOCK + 778), (5 * BLOCK, 1000), (6 * BLOCK, 1)])
def test_a_direct_read_past_the_end_is_an_eof_error(direct_file, offset, nbytes):
    data, direct, _ = direct_file
    for layout in ("straight", "scratch"):
        with pytest.raises(EOFError) as end:
            _into(direct, offset, nbytes, layout)
        assert end.value.args[0] == len(data)  # where the file ends


def _room(offset: int, nbytes: int) -> tuple[np.ndarray, int]:
    """Block-aligned memory for pread_direct_at, a guard block each side; the address at which
    the bytes of `offset` are to land (congruent to it modulo BLOCK)."""
    mem = np.full(-(-(offset % BLOCK + nbytes) // BLOCK) * BLOCK + 4 * BLOCK, 0xAB, np.uint8)
    pad = -mem.ctypes.data % BLOCK
    return mem, mem.ctypes.data + pad + BLOCK + offset % BLOCK


@pytest.mark.parametrize("offset,nbytes", [(0, BLOCK), (123, 3 * BLOCK + 5), (BLOCK - 1, 2), (5 * BLOCK + 700, 77),
                                           (0, 5 * BLOCK + 777)])
@pytest.mark.parametrize("chunk", [0, BLOCK, 2 * BLOCK])
def test_direct_reads_straight_to_memory_land_where_asked(direct_file, offset, nbytes, chunk):
    """pread_direct_at: the file's bytes at addr, in requests of any whole-block size, nothing
    written outside the blocks around them (the guard blocks keep their fill)."""
    data, direct, path = direct_file
    mem, addr = _room(offset, nbytes)
    assert direct_io.pread_direct_at(direct, addr, offset, nbytes, chunk) == nbytes
    start = addr - mem.ctypes.data
    assert mem[start:start + nbytes].tobytes() == data[offset:offset + nbytes]
    lo, hi = start - offset % BLOCK, start - offset % BLOCK + -(-(offset % BLOCK + nbytes) // BLOCK) * BLOCK
    assert (mem[:lo] == 0xAB).all() and (mem[hi:] == 0xAB).all()
    assert resident_pages(path) == 0


def test_a_direct_read_straight_to_memory_stops_between_requests(direct_file):
    data, direct, _ = direct_file
    mem, addr = _room(100, 4 * BLOCK)
    asked = []
    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2  # two requests, then stop
    assert direct_io.pread_direct_at(direct, addr, 100, 4 * BLOCK, BLOCK, stop) == 2 * BLOCK - 100
    start = addr - mem.ctypes.data
    assert mem[start:start + 2 * BLOCK - 100].tobytes() == data[100:2 * BLOCK]
    assert direct_io.pread_direct_at(direct, addr, 100, 4 * BLOCK, BLOCK, lambda: True) == 0


def test_a_direct_read_straight_to_memory_checks_its_layout_and_the_end(direct_file):
    data, direct, _ = direct_file
    mem, addr = _room(100, BLOCK)
    with pytest.raises(ValueError, match="not congruent"):
        direct_io.pread_direct_at(direct, addr + 1, 100, BLOCK)
    with pytest.raises(ValueError, match="whole blocks"):
        direct_io.pread_direct_at(direct, addr, 100, BLOCK, chunk=1000)
    mem, addr = _room(5 * BLOCK, 1000)
    with pytest.raises(EOFError) as end:
        direct_io.pread_direct_at(direct, addr, 5 * BLOCK, 1000)
    assert end.value.args[0] == len(data)


def test_open_direct_refuses_a_path_that_is_another_file_now(tmp_path):
    (tmp_path / "a").write_bytes(b"a" * BLOCK)
    fd = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        os.replace(tmp_path / "a", tmp_path / "old")
        (tmp_path / "a").write_bytes(b"b" * BLOCK)
        assert open_direct(fd, tmp_path / "a") is None
    finally:
        os.close(fd)
