"""The slots a memory budget streams layer trunks through (backends/streaming/executor.py): tensors near each
other in the file are one run, laid out in the slot as in the file at a place congruent modulo
the block, so one O_DIRECT read brings a run in; the bytes are the file's at every tensor's slot
offset (O_DIRECT or buffered), the slot never overflows, and a short read is one clean error."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from gguf_arch.io.direct_io import BLOCK, open_direct
from ggml_graph_spec.backends.streaming.experts import ShortReadError
from ggml_graph_spec.backends.streaming import experts
from ggml_graph_spec.backends.streaming.layer_files import _GAP, Piece, place_pieces, read_layer

# (offset, bytes) of a layer's trunk tensors: 32-aligned neighbours, a gap of exactly _GAP, a far one
TENSORS = [(100, 5000), (5120, 64), (5184, 3 * BLOCK + 7), (5184 + 3 * BLOCK + 7 + _GAP, 900), (200_000, 12345)]


@pytest.fixture
def trunk(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, 230_000, dtype=np.uint8)
    path = tmp_path / "trunk.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, str(path), data
    os.close(fd)


def _aligned(n: int) -> np.ndarray:
    mem = np.zeros(n + BLOCK, np.uint8)
    return mem[-mem.ctypes.data % BLOCK:][:n]


def _layout(fd: int, path: str, direct):
    pieces = [Piece(None, fd, path, off, n, 0) for off, n in TENSORS]
    return place_pieces(pieces, {fd: direct})


def test_neighbours_are_one_run_laid_out_as_in_the_file(trunk):
    fd, path, _ = trunk
    pieces, runs, size = _layout(fd, path, None)
    assert [(r.file_offset, r.nbytes) for r in runs] == [(100, TENSORS[3][0] + 900 - 100), (200_000, 12345)]
    for r in runs:
        assert (r.slot_offset - r.file_offset) % BLOCK == 0
    for p in pieces:  # a tensor keeps its distance from its run's start
        r = next(r for r in runs if r.file_offset <= p.file_offset < r.file_offset + r.nbytes)
        assert p.slot_offset - r.slot_offset == p.file_offset - r.file_offset
    assert size % BLOCK == 0 and size >= max(r.slot_offset + r.nbytes for r in runs)
    assert runs[1].slot_offset - runs[1].file_offset % BLOCK >= runs[0].slot_offset + runs[0].nbytes  # no overlap


@pytest.mark.parametrize("how", ["direct", "buffered"])
def test_a_layer_read_holds_the_files_bytes_at_every_tensor(trunk, how):
    fd, path, data = trunk
    direct = open_direct(fd, path) if how == "direct" else None
    if how == "direct" and direct is None:
        pytest.skip("the file system of the test's tmp_path refuses O_DIRECT")
    try:
        pieces, runs, size = _layout(fd, path, direct)
        mem = np.full(size + 3 * BLOCK, 0xCD, np.uint8)
        pad = -mem.ctypes.data % BLOCK
        slot = mem[pad + BLOCK:pad + BLOCK + size]
        assert read_layer(runs, slot) == sum(r.nbytes for r in runs)
        for p in pieces:
            assert slot[p.slot_offset:p.slot_offset + p.nbytes].tobytes() == data[p.file_offset:p.file_offset + p.nbytes].tobytes()
        assert (mem[:pad + BLOCK] == 0xCD).all() and (mem[pad + BLOCK + size:] == 0xCD).all()  # nothing outside the slot
        beyond = [Piece(None, fd, path, len(data) - 100, 200, 0)]
        _, short, n = place_pieces(beyond, {fd: direct})
        with pytest.raises(ShortReadError, match="trunk.bin: short read at offset"):
            read_layer(short, _aligned(n))
    finally:
        if direct is not None:
            os.close(direct)


def test_a_refused_direct_read_falls_back_to_pread(trunk, monkeypatch):
    """A file system that takes O_DIRECT at open but refuses the read (EINVAL): the same bytes, buffered."""
    fd, path, data = trunk
    direct = open_direct(fd, path)
    if direct is None:
        pytest.skip("the file system of the test's tmp_path refuses O_DIRECT")
    code = [errno.EINVAL]
    def refuse(*_args, **_kw):
        raise OSError(code[0], os.strerror(code[0]))
    monkeypatch.setattr(experts, "pread_direct_at", refuse)  # the reads the trunks share with the experts
    try:
        pieces, runs, size = _layout(fd, path, direct)
        slot = _aligned(size)
        assert read_layer(runs, slot) == sum(r.nbytes for r in runs)
        for p in pieces:
            assert slot[p.slot_offset:p.slot_offset + p.nbytes].tobytes() == data[p.file_offset:p.file_offset + p.nbytes].tobytes()
        code[0] = errno.EIO
        with pytest.raises(OSError, match=os.strerror(errno.EIO)):  # any other error is raised as it is
            read_layer(runs, slot)
    finally:
        os.close(direct)
