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

On the fast path, where an expert's slice is whole blocks (a K3.1-Pro's: 5.8 MB = 1428 x 4096),
the entries are `pitched`: one block of room each, and each layer's tensor starts at its stacks'
file offset modulo the block (its nb[2] is the pitch), so a missed expert is read with O_DIRECT
straight into its entry (no bounce buffer, no copy: on 2 cores the copy's CPU time was the
expert matmuls'). The exact path's dequantizing get_rows needs a contiguous stack: there the
entries are the stride apart.
"""
from __future__ import annotations

import ctypes
import errno
import heapq
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import ggml
import numpy as np

from gguf_arch.errors import KimiError
from gguf_arch.io.direct_io import BLOCK, pread_direct_at, scratch

READERS = 4  # parallel preads of the missed experts: a disk serves several requests at once
# An expert read around the page cache goes in requests of this size (straight into a pitched
# entry, or each through its reader's block-aligned buffer, scratch); between two, a prediction
# let go stops its read. Measured here, 4 readers of random 5.7 MB slices: 2 MiB and 1 MiB
# requests 1.36-1.61 GB/s, whole slices 1.09-1.33.
EXPERT_REQUEST = 2 << 20


class ShortReadError(KimiError):
    """A weight file ended before the bytes the GGUF's header says it holds."""


def _short_read(path: str, offset: int, missing: int) -> ShortReadError:
    return ShortReadError(f"{path}: short read at offset {offset}: expected {missing} more bytes of a weight "
                          "tensor (the file was truncated or changed after loading)")


def pread_into(fd: int, path: str, addr: int, nbytes: int, offset: int) -> int:
    """Read exactly nbytes at `offset` of the file to memory at addr, then drop their pages; nbytes."""
    view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise _short_read(path, offset + done, nbytes - done)
        done += n
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    return nbytes


def pread_direct_into(direct: int, path: str, addr: int, nbytes: int, offset: int, room: bool = False,
                      stop: Callable[[], bool] | None = None, chunk: int = EXPERT_REQUEST) -> int:
    """pread_into through an O_DIRECT descriptor, in requests of `chunk` bytes: the kernel neither
    copies the bytes into the page cache nor spends the CPU time to (which the expert matmuls
    computing meanwhile share); one copy from the reader's aligned buffer (scratch) to addr
    instead, or none with `room` (addr congruent to offset modulo BLOCK, the whole blocks around
    the bytes the caller's: pread_direct_at). `stop()`, asked between requests, ends the read
    early; returns the bytes delivered."""
    try:
        if room:
            return pread_direct_at(direct, addr, offset, nbytes, chunk, stop)
        for done in range(0, nbytes, chunk):
            if stop is not None and stop():
                return done
            n = min(chunk, nbytes - done)
            at = scratch(offset + done, n)
            pread_direct_at(direct, at, offset + done, n)
            ctypes.memmove(addr + done, at, n)
        return nbytes
    except EOFError:
        raise _short_read(path, offset, nbytes) from None


def read_range(fd: int, direct: int | None, path: str, addr: int, nbytes: int, offset: int, room: bool = False,
               stop: Callable[[], bool] | None = None, chunk: int = EXPERT_REQUEST) -> int:
    """`nbytes` at `offset` of the file to memory at addr: through `direct` (its O_DIRECT
    descriptor, pread_direct_into's `room`, `stop` and `chunk`) where there is one, else, or where
    the file system took the flag but refuses the read, buffered (pread_into); the bytes read."""
    if direct is not None:
        try:
            return pread_direct_into(direct, path, addr, nbytes, offset, room, stop, chunk)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return pread_into(fd, path, addr, nbytes, offset)


@dataclass(frozen=True)
class ExpertStack:
    """One layer's stacked expert tensor (gate, up or down) in a GGUF file."""

    tensor: object  # ggml_tensor_p, data in the mapping
    fd: int
    path: str
    file_offset: int
    stride: int  # bytes of one expert: nb[2]
    count: int  # ne[2]
    direct: int | None = None  # the file open with O_DIRECT, where the file system allows it

    def read(self, addr: int, expert: int, room: bool = False, stop: Callable[[], bool] | None = None) -> int:
        """Expert `expert`'s bytes of this stack to memory at addr (`room`, `stop`: pread_direct_into's);
        the bytes read."""
        return read_range(self.fd, self.direct, self.path, addr, self.stride, self.file_offset + expert * self.stride,
                          room, stop)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        t = self.tensor.contents
        return (t.type, t.ne[0], t.ne[1], self.stride)


def pitches(strides: list[int], pitched: bool) -> list[int]:
    """Bytes from one entry of a kind to the next: the stride, or with a block of room where asked
    (the fast path) and every stride is whole blocks (module docstring)."""
    room = BLOCK if pitched and all(s % BLOCK == 0 for s in strides) else 0
    return [s + room for s in strides]


class ExpertCache:
    """`entries` experts of the shape `kinds` (one ExpertStack.shape per kind) in anonymous memory
    (a buffer of the CPU backend's buffer type `buft`), `pitched` where it can be (pitches()).

    Speculative reads (`place(..., ahead=...)`): while a layer computes, the experts predicted for
    the next MoE layer are read into entries the current layer does not use, on the reader
    threads. When the next layer's real selection comes, a predicted expert it selects is waited
    for (useful), the others are let go (wasted: a read not yet started is cancelled, the entry is
    emptied either way, so the cache's contents do not depend on the reads' timing). A predicted
    expert counts as a miss all the same (it had to be read), so hits, misses and the entries held
    are those of a run without prediction only when every prediction is right or wasted."""

    def __init__(self, kinds: list[tuple[int, int, int, int]], entries: int, buft, pitched: bool = False):
        self.kinds, self.entries = kinds, entries
        self.pitches = pitches([k[3] for k in kinds], pitched)
        self.pitched = self.pitches[0] != kinds[0][3]
        offsets, off = [], 0
        for pitch in self.pitches:
            offsets.append(off)
            off += -(-entries * pitch // BLOCK) * BLOCK  # each region block-aligned
        self.nbytes = off
        self._buffer = ggml.ggml_backend_buft_alloc_buffer(buft, off + BLOCK)
        if not self._buffer:
            raise MemoryError(f"cannot allocate an expert cache of {off} bytes")
        base = ggml.ggml_backend_buffer_get_base(self._buffer)
        base += -base % BLOCK
        self.bases = [base + o for o in offsets]
        self._where: dict[tuple[int, int], int] = {}
        self._owner: list[tuple[int, int] | None] = [None] * entries
        self._free = list(range(entries))  # the empty entries, a heap: the lowest first
        self.uses: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}
        # The held entries by eviction order, a heap of (uses, last, layer, expert, entry) pushed at
        # every change, the stale ones (a newer push, another owner) dropped when met (_order)
        self._order: list[tuple[int, int, int, int, int]] = []
        self._tick = 0
        self.hits = self.misses = self.bytes_read = 0
        self.predicted = self.useful = self.wasted = self.wasted_bytes = 0  # speculative reads (class docstring)
        self._guesses: dict[tuple[int, int], int] = {}  # predicted experts not yet resolved -> entry
        self._inflight: dict[int, list[Future]] = {}  # entry -> its reads not yet waited for
        self._stops: dict[int, threading.Event] = {}  # entry -> set: its reads stop (a prediction let go)
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kimi-k3-experts")

    @property
    def expert_bytes(self) -> int:
        return sum(k[3] for k in self.kinds)

    @property
    def miss_bytes(self) -> int:
        """Bytes of the selected experts the cache did not hold before their layer (or its prediction)."""
        return self.misses * self.expert_bytes

    def _shift(self, stack: ExpertStack) -> int:
        """Where a layer's experts start in their entries: at their file offset's place in a block (pitched)."""
        return stack.file_offset % BLOCK if self.pitched else 0

    def address(self, kind: int, entry: int, stack: ExpertStack) -> int:
        """Where `entry` holds an expert of `stack` (of kind `kind`)."""
        return self.bases[kind] + entry * self.pitches[kind] + self._shift(stack)

    def tensors(self, ctx, names: list[bytes], stacks: list[ExpertStack]) -> list:
        """One graph tensor per kind over its region, for the layer of `stacks`. Its ne[2] (what
        ggml checks the ids against) is the larger of the entries and the layer's expert count, so
        the same tensor can also be pointed at the layer's mapped stack (with the stack's stride);
        only the entries given as ids are read."""
        out = []
        for kind, ((typ, ne0, ne1, _), name, stack) in enumerate(zip(self.kinds, names, stacks)):
            t = ggml.ggml_new_tensor_3d(ctx, typ, ne0, ne1, max(self.entries, stack.count))
            ggml.ggml_set_name(t, name)
            t.contents.buffer, t.contents.data = self._buffer, self.address(kind, 0, stack)
            t.contents.nb[2] = self.pitches[kind]
            t.contents.nb[3] = self.pitches[kind] * t.contents.ne[2]
            out.append(t)
        return out

    def place(self, layer: int, stacks: list[ExpertStack], experts: np.ndarray,
              ahead: tuple[int, list[ExpertStack], np.ndarray] | None = None,
              during: Callable[[], None] | None = None, settle: bool = True) -> np.ndarray | None:
        """The entry of each of `experts` (distinct ids), reading the ones not held (in the order
        given); None when they are more than the cache holds (the caller then reads the layer's
        experts whole). `ahead` (layer, stacks, experts): a prediction of the next layer's, queued
        behind this layer's misses and not waited for (read_ahead). `during()`, called once in
        either case, runs while the reads do, before they are waited for; with `settle` False
        they are not waited for here: the caller waits for each entry with ready() before it
        reads it, and for all of them before the next place()."""
        keys = [(layer, int(e)) for e in experts]
        useful = self._resolve(set(keys) if len(keys) <= self.entries else set())
        if len(keys) > self.entries:
            if during is not None:
                during()
            return None
        self._tick += 1
        for k in keys:
            self.uses[k] = self.uses.get(k, 0) + 1
            self._last[k] = self._tick
            if k in self._where:
                self._rank(k, self._where[k])
        missing = [k for k in keys if k not in self._where]
        self.hits += len(keys) - len(missing) - len(useful)
        self.misses += len(missing) + len(useful)
        for k, entry in zip(missing, self._victims(len(missing), set(keys), wait=True)):
            self._assign(k, entry)
        for k in missing:
            self._inflight[self._where[k]] = self._submit(stacks, k[1], self._where[k])
        if ahead is not None:  # queued behind this layer's reads: a reader they leave idle starts one
            self.read_ahead(*ahead, keep=set(keys))
        if during is not None:
            during()
        entries = np.array([self._where[k] for k in keys], dtype=np.int32)
        if settle:
            self.ready(entries)
        return entries

    def ready(self, entries: np.ndarray) -> None:
        """Wait for the reads into `entries` still in flight (place's `settle`)."""
        for entry in dict.fromkeys(entries.tolist()):
            if entry in self._inflight:
                self._settle(entry)

    def _resolve(self, selected: set) -> list[tuple[int, int]]:
        """The predicted experts among `selected` (useful); the other predictions let go."""
        useful = [k for k in self._guesses if k in selected]
        for k, entry in self._guesses.items():
            if k in selected:
                continue
            self.wasted += 1
            self._stops[entry].set()
            reads = self._inflight.get(entry, [])
            if all([f.cancel() for f in reads]):  # every one: a read not started is not made
                self._inflight.pop(entry, None)
            del self._where[k]
            self._owner[entry] = None
            heapq.heappush(self._free, entry)
        self.useful += len(useful)
        self._guesses = {}
        return useful

    def read_ahead(self, layer: int, stacks: list[ExpertStack], experts: np.ndarray,
                   keep: frozenset | set = frozenset()) -> None:
        """Start reading the predicted experts of `layer` not held into entries `keep`'s do not use
        (class docstring); the next place() resolves them."""
        want = [(layer, int(e)) for e in experts if (layer, int(e)) not in self._where]
        for k, entry in zip(want, self._victims(len(want), keep, wait=False)):
            self._assign(k, entry)
            self._guesses[k] = entry
            self._inflight[entry] = self._submit(stacks, k[1], entry)
            self.predicted += 1

    def _assign(self, k: tuple[int, int], entry: int) -> None:
        old = self._owner[entry]
        if old is not None:
            del self._where[old]
        self._owner[entry], self._where[k] = k, entry
        self._rank(k, entry)

    def _rank(self, k: tuple[int, int], entry: int) -> None:
        """(Re)file held entry `entry` (of k) in the eviction order, rebuilt from the held entries
        when stale ones outnumber them: the scan per call it replaces took 1.5 ms at 4,000 entries."""
        heapq.heappush(self._order, self._key(entry, k))
        if len(self._order) > 4 * self.entries + 64:
            self._order = [self._key(e) for e, owner in enumerate(self._owner) if owner is not None]
            heapq.heapify(self._order)

    def _key(self, entry: int, k: tuple[int, int] | None = None) -> tuple[int, int, int, int, int]:
        k = k or self._owner[entry]
        return (self.uses.get(k, 0), self._last.get(k, 0), *k, entry)

    def _victims(self, n: int, keep: set, wait: bool) -> list[int]:
        """Up to n entries to overwrite, none held by `keep`: empty ones first (lowest first),
        then the least used (module docstring; from the eviction order, _rank). An entry still
        being read is waited for (`wait`) or passed over."""
        empty, busy = [], []
        while self._free and len(empty) < n:
            entry = heapq.heappop(self._free)
            (busy if entry in self._inflight and not wait else empty).append(entry)
        for entry in busy:
            heapq.heappush(self._free, entry)
        passed = []
        while len(empty) < n and self._order:
            item = heapq.heappop(self._order)
            entry = item[-1]
            if self._owner[entry] is None or item != self._key(entry):
                continue  # stale: emptied, owned by another, or filed again since
            if self._owner[entry] in keep or (not wait and entry in self._inflight):
                passed.append(item)
            else:
                empty.append(entry)
        for item in passed:
            heapq.heappush(self._order, item)
        for entry in empty:
            if entry in self._inflight:
                self._settle(entry)
        return empty

    def _submit(self, stacks: list[ExpertStack], expert: int, entry: int) -> list[Future]:
        stop = self._stops[entry] = threading.Event()
        return [self._readers.submit(s.read, self.address(kind, entry, s), expert, self.pitched, stop.is_set)
                for kind, s in enumerate(stacks)]

    def _settle(self, entry: int) -> None:
        """Wait for the reads into `entry` (an error of one is raised here, as it was)."""
        reads = self._inflight.pop(entry, [])
        self._stops.pop(entry, None)
        try:
            for f in reads:
                if not f.cancelled():
                    f.result()
        finally:
            done = sum(f.result() for f in reads if f.done() and not f.cancelled() and f.exception() is None)
            self.bytes_read += done
            if self._owner[entry] is None:
                self.wasted_bytes += done

    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    def free(self) -> None:
        self._readers.shutdown(cancel_futures=True)
        if self._buffer:
            ggml.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
