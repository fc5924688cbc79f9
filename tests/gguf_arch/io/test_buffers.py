"""Placed chunk buffers: laid out for a file offset, the blocks around them their own, reused once
the last view of a chunk is gone, never handed out twice, and fresh memory beyond the set."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from gguf_arch.io.buffers import BufferSet
from gguf_arch.io.direct_io import BLOCK

SLOT = 4 * BLOCK


@pytest.mark.parametrize("place", [0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 77, 10 ** 12 + 5])
@pytest.mark.parametrize("nbytes", [0, 1, BLOCK, 3 * BLOCK - 1, 5 * BLOCK])
def test_a_buffer_is_congruent_to_its_place_and_writable(place, nbytes):
    a = BufferSet(2, SLOT).placed(nbytes, place)
    assert a.dtype == np.uint8 and a.size == nbytes and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % BLOCK == place % BLOCK
    a[:] = 7  # its own memory


def test_the_blocks_around_each_buffer_are_its_own():
    """Filling the whole blocks around each of several buffers (what an O_DIRECT read into them
    does) leaves every other buffer's bytes alone, in the set and beyond it (fresh memory)."""
    s = BufferSet(3, SLOT)
    bufs = [s.placed(n, place) for n, place in [(BLOCK, 5), (3 * BLOCK, BLOCK - 1), (100, 0), (BLOCK + 3, 9),
                                                  (6 * BLOCK, 1)]]
    assert s.in_use() == 3
    for i, b in enumerate(bufs):
        b[:] = i
    for i, b in enumerate(bufs):
        lead = b.ctypes.data % BLOCK
        around = -(-(lead + b.size) // BLOCK) * BLOCK
        room = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * around).from_address(b.ctypes.data - lead))
        room[:] = 0xEE
        assert all((o == j).all() for j, o in enumerate(bufs) if j != i)
        b[:] = i


def test_a_slot_comes_back_when_the_last_view_is_gone():
    s = BufferSet(2, SLOT)
    a = s.placed(BLOCK, 0)
    addr = a.ctypes.data
    view = memoryview(a.view(np.uint16)[3:])  # what a consumer keeps: a view of a view
    del a
    gc.collect()
    assert s.in_use() == 1
    del view
    assert s.in_use() == 0
    b = s.placed(2 * BLOCK, 0)  # the last one freed is reused first
    assert b.ctypes.data == addr and s.in_use() == 1


def test_beyond_the_set_buffers_are_fresh_memory():
    s = BufferSet(2, SLOT)
    held = [s.placed(BLOCK, 0), s.placed(BLOCK, 0)]
    extra, large = s.placed(BLOCK, 100), s.placed(SLOT, 1)  # the set is in use; too large for a slot
    assert s.in_use() == 2
    assert extra.ctypes.data % BLOCK == 100 and large.ctypes.data % BLOCK == 1
    addrs = {int(h.ctypes.data) for h in held}
    assert extra.ctypes.data not in addrs and large.ctypes.data not in addrs
    del held, extra, large
    assert s.in_use() == 0


def test_slots_must_be_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks"):
        BufferSet(1, BLOCK + 1)
