"""The routed experts of streamed MoE layers: where each layer's stacked expert tensors are in the
file, and the expert cache that holds the experts tokens select.

A stacked expert tensor (ggml ne [in, out, n_expert], contiguous) holds expert e at byte
e * nb[2]: one contiguous slice of the file. The cache keeps `entries` experts in one anonymous
ggml CPU buffer with one region per kind (gate, up, down), entry i of a kind at region + i * nb[2],
so a region is itself a stack of experts: the graph's expert matmuls read it through a tensor of
the stacked shape, with the router's ids rewritten to entry numbers. It is also the working set:
the experts a layer's tokens select are read into it (those it does not hold already), evicting
the least frequently used others (uses counted per (layer, expert) over the whole run; ties go
to the least recently used, then the lowest layer and expert: deterministic).
"""
from __future__ import annotations

import ctypes
import heapq
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ggml
import numpy as np

from gguf_arch.errors import KimiError

_ALIGN = 64
_READERS = 4  # parallel preads of the missed experts: a disk serves several requests at once


class ShortReadError(KimiError):
    """A weight file ended before the bytes the GGUF's header says it holds."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pread_into(fd: int, path: str, addr: int, nbytes: int, offset: int) -> None:
    """Read exactly nbytes at `offset` of the file to memory at addr, then drop their pages."""
    view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ShortReadError(f"{path}: short read at offset {offset + done}: expected {nbytes - done} "
                                 "more bytes of a weight tensor (the file was truncated or changed after loading)")
        done += n
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


@dataclass(frozen=True)
class ExpertStack:
    """One layer's stacked expert tensor (gate, up or down) in a GGUF file."""

    tensor: object  # ggml_tensor_p, data in the mapping
    fd: int
    path: str
    file_offset: int
    stride: int  # bytes of one expert: nb[2]
    count: int  # ne[2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        t = self.tensor.contents
        return (t.type, t.ne[0], t.ne[1], self.stride)


class ExpertCache:
    """`entries` experts of the shape `kinds` (one ExpertStack.shape per kind) in anonymous memory
    (a buffer of the CPU backend's buffer type `buft`)."""

    def __init__(self, kinds: list[tuple[int, int, int, int]], entries: int, buft):
        self.kinds, self.entries = kinds, entries
        offsets, off = [], 0
        for _, _, _, stride in kinds:
            offsets.append(off)
            off += _align(entries * stride)
        self.nbytes = off
        self._buffer = ggml.ggml_backend_buft_alloc_buffer(buft, off)
        if not self._buffer:
            raise MemoryError(f"cannot allocate an expert cache of {off} bytes")
        base = ggml.ggml_backend_buffer_get_base(self._buffer)
        self.bases = [base + o for o in offsets]
        self._where: dict[tuple[int, int], int] = {}
        self._owner: list[tuple[int, int] | None] = [None] * entries
        self._free = list(range(entries - 1, -1, -1))  # the empty entries, popped lowest first
        self.uses: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}
        self._tick = 0
        self.hits = self.misses = self.bytes_read = 0
        self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix="kimi-k3-experts")

    def tensors(self, ctx, names: list[bytes], count: int) -> list:
        """One graph tensor per kind over its region. Its ne[2] (what ggml checks the ids
        against) is the larger of the entries and the layer's expert `count`, so the same tensor
        can also be pointed at the layer's mapped stack; only the entries given as ids are read."""
        out = []
        for (typ, ne0, ne1, _), base, name in zip(self.kinds, self.bases, names):
            t = ggml.ggml_new_tensor_3d(ctx, typ, ne0, ne1, max(self.entries, count))
            ggml.ggml_set_name(t, name)
            t.contents.buffer, t.contents.data = self._buffer, base
            out.append(t)
        return out

    def place(self, layer: int, stacks: list[ExpertStack], experts: np.ndarray) -> np.ndarray | None:
        """The entry of each of `experts` (distinct ids), reading the ones not held; None when
        they are more than the cache holds (the caller then reads the layer's experts whole)."""
        if len(experts) > self.entries:
            return None
        self._tick += 1
        keys = [(layer, int(e)) for e in experts]
        for k in keys:
            self.uses[k] = self.uses.get(k, 0) + 1
            self._last[k] = self._tick
        missing = [k for k in keys if k not in self._where]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        for k, entry in zip(missing, self._victims(len(missing), set(keys))):
            old = self._owner[entry]
            if old is not None:
                del self._where[old]
            self._owner[entry], self._where[k] = k, entry
        self._read(stacks, [(k[1], self._where[k]) for k in missing])
        return np.array([self._where[k] for k in keys], dtype=np.int32)

    def _victims(self, n: int, keep: set) -> list[int]:
        """n entries to overwrite: empty ones first (lowest first), then the least used (module
        docstring; the scan over the held entries only once the cache is full)."""
        empty = [self._free.pop() for _ in range(min(n, len(self._free)))]
        if len(empty) == n:
            return empty
        held = (i for i in range(self.entries) if self._owner[i] is not None and self._owner[i] not in keep)
        return empty + heapq.nsmallest(n - len(empty), held, key=lambda i: (self.uses[self._owner[i]],
                                                                             self._last[self._owner[i]], *self._owner[i]))

    def _read(self, stacks: list[ExpertStack], jobs: list[tuple[int, int]]) -> None:
        reads = [(s.fd, s.path, base + entry * s.stride, s.stride, s.file_offset + e * s.stride)
                 for e, entry in sorted(jobs) for s, base in zip(stacks, self.bases)]
        for f in [self._readers.submit(pread_into, *r) for r in reads]:
            f.result()
        self.bytes_read += sum(r[3] for r in reads)

    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    def free(self) -> None:
        self._readers.shutdown()
        if self._buffer:
            ggml.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
