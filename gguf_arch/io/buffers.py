"""Chunk buffers laid out for O_DIRECT, from a bounded set of reused ones.

Why: a conversion moves every byte through a buffer of ~16 MiB several hundred times a GB. A
fresh buffer per chunk costs its page faults (the kernel zero-fills each page first: 4-5% of a
conversion's CPU in perf), and a buffer at an arbitrary address forces the O_DIRECT writer to
copy the chunk into aligned staging memory first (~0.1 CPU-s per GB, the largest part of the
write stage). So the reader and the MXFP4 repack produce their chunks in `placed` buffers: at an
address congruent modulo BLOCK to a file offset (the chunk's offset in the output file, so the
writer writes its whole blocks straight from it; or its offset in the shard, so an O_DIRECT read
lands straight in it), with the whole blocks around it owned too.

Memory stays bounded: the set holds SLOTS buffers of SLOT_BYTES, each taken by one array and
given back when the last view of that array is gone (a chunk lives until it is scanned, hashed
and written). When every slot is in use, or a request is larger than a slot, the buffer is a
fresh allocation freed as any array: the number of chunks in flight is bounded by the queues of
the pipeline, not here. Slots are reused last-freed first, so only as many are ever touched as
chunks were in flight at once.
"""
from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

from .direct_io import BLOCK

# A chunk of the transforms (16 MiB) with the blocks around it.
SLOT_BYTES = (16 << 20) + 2 * BLOCK
# Chunks in flight at -j 2 (measured: reads ahead, the scan's, digest's and writer's queues, the
# next tensor's first chunk); more threads fall back to fresh buffers beyond these.
SLOTS = 16


def _whole_blocks(pad: int, nbytes: int) -> int:
    return -(-(pad + nbytes) // BLOCK) * BLOCK


class BufferSet:
    """`slots` reusable buffers of `slot_bytes` in one anonymous mapping (untouched pages cost
    nothing); with none, every buffer is fresh memory."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        if slot_bytes % BLOCK:
            raise ValueError(f"slots must be whole blocks of {BLOCK} bytes, got {slot_bytes}")
        self.slot_bytes, self.slots = slot_bytes, slots
        self._memory = mmap.mmap(-1, slots * slot_bytes) if slots else None
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def placed(self, nbytes: int, place: int) -> np.ndarray:
        """A writable uint8 array of `nbytes` whose address is congruent to `place` modulo BLOCK,
        the whole blocks around it the array's own (an O_DIRECT read may fill them)."""
        pad = place % BLOCK
        slot = self._take() if _whole_blocks(pad, nbytes) <= self.slot_bytes else None
        if slot is None:
            room = np.empty(_whole_blocks(pad, nbytes) + BLOCK, np.uint8)
            start = -room.ctypes.data % BLOCK + pad
            return room[start:start + nbytes]
        a = np.frombuffer(self._memory, np.uint8, nbytes, slot * self.slot_bytes + pad)
        weakref.finalize(a, self._give, slot).atexit = False
        return a

    def in_use(self) -> int:
        """Slots taken and not given back."""
        with self._lock:
            return self.slots - len(self._free)

    def _take(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def _give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


_shared = BufferSet()


def placed(nbytes: int, place: int) -> np.ndarray:
    """A buffer of the process's shared set (see BufferSet.placed)."""
    return _shared.placed(nbytes, place)

