"""Layers read from the file per token through rotating slots, the next one read while the
current one computes.

The graph is built and allocated as always (weights mapped from the file); only its compute
changes: the executor runs it one segment (layer) at a time through `ggml_graph_view`, and
before a streamed layer's segment points that layer's weight tensors (and the graph's views of
them, whose addresses ggml-alloc fixed from the mapping) at a slot the prefetch thread filled
with `pread`. Reads are large and sequential (each tensor whole, in file order), and the pages
they went through are dropped (POSIX_FADV_DONTNEED) so the page cache holds none of the
streamed layers and the pinned prefix keeps its pages (mlock, best effort).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import ggml
import numpy as np

from ..graph import Executor, GraphBuild
from .budget import N_SLOTS, BudgetPlan, plan_budget

_ALIGN = 64  # slot offsets: above ggml's TENSOR_ALIGNMENT (32)
_LAYER = re.compile(r"blk\.(\d+)\.")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Piece:
    """One weight tensor of a layer: where its bytes are in a file and in a slot."""

    tensor: object  # ggml_tensor_p
    fd: int
    file_offset: int
    nbytes: int
    slot_offset: int


class LayerFiles:
    """The layers' tensors located in the GGUF files (open read-only for pread)."""

    def __init__(self, weights):
        self._fds = [os.open(path, os.O_RDONLY) for path, _, _ in weights.mapped_files]
        maps = [(base, size) for _, base, size in weights.mapped_files]
        self.layers: dict[int, list[_Piece]] = {}
        self.outside = 0  # bytes of the tensors no layer owns (embedding, head)
        for name, t in weights.tensors.items():
            m = _LAYER.match(name)
            if m is None:
                self.outside += ggml.ggml_nbytes(t)
                continue
            self.layers.setdefault(int(m.group(1)), []).append(self._locate(t, maps))
        for layer, pieces in self.layers.items():
            pieces.sort(key=lambda p: (p.fd, p.file_offset))  # sequential reads
            self.layers[layer] = _place(pieces)

    def _locate(self, t, maps) -> _Piece:
        addr = t.contents.data
        for fd, (base, size) in zip(self._fds, maps):
            if base <= addr < base + size:
                return _Piece(t, fd, addr - base, ggml.ggml_nbytes(t), 0)
        raise ValueError(f"tensor {ggml.ggml_get_name(t)!r} is not in a mapped GGUF file")

    def layer_bytes(self) -> list[int]:
        return [sum(_align(p.nbytes) for p in self.layers.get(l, ())) for l in range(max(self.layers) + 1)]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _place(pieces: list[_Piece]) -> list[_Piece]:
    out, off = [], 0
    for p in pieces:
        out.append(_Piece(p.tensor, p.fd, p.file_offset, p.nbytes, off))
        off += _align(p.nbytes)
    return out


def read_layer(pieces: list[_Piece], slot: np.ndarray) -> int:
    """pread a layer's tensors into `slot`, then drop their pages from the page cache."""
    total = 0
    for p in pieces:
        view = memoryview(slot)[p.slot_offset:p.slot_offset + p.nbytes]
        done = 0
        while done < p.nbytes:
            n = os.preadv(p.fd, [view[done:]], p.file_offset + done)
            if n <= 0:
                raise OSError(f"short read of a weight tensor at offset {p.file_offset + done}")
            done += n
        os.posix_fadvise(p.fd, p.file_offset, p.nbytes, os.POSIX_FADV_DONTNEED)
        total += p.nbytes
    return total


def _mlock(pieces: list[_Piece]) -> bool:
    """Pin a layer's mapped pages; False where the kernel refuses (RLIMIT_MEMLOCK)."""
    ok = True
    for p in pieces:
        ok &= _libc.mlock(ctypes.c_void_p(p.tensor.contents.data), ctypes.c_size_t(p.nbytes)) == 0
    return ok


class StreamingExecutor(Executor):
    """The CPU executor with a memory budget (module docstring). The plan is made at the first
    graph, when the compute buffer's size is known; `attach` gives it the caches' size."""

    segments = True  # each layer's nodes contiguous, in order (GraphBuild.begin_segment)

    def __init__(self, weights, budget: int, n_threads: int):
        super().__init__(n_threads)
        self.budget = budget
        self.files = LayerFiles(weights)
        self.plan_: BudgetPlan | None = None
        self.mlocked = False
        self.bytes_read = 0
        self._cache_bytes = 0
        self._slots: list[np.ndarray] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kimi-k3-prefetch")
        self._pending: dict[int, Future] = {}
        self._loads = 0

    def attach(self, cache_bytes: int) -> None:
        self._cache_bytes = cache_bytes

    def _make_plan(self) -> BudgetPlan:
        compute = ggml.ggml_gallocr_get_buffer_size(self._galloc, 0)
        plan = plan_budget(self.budget, self.files.outside + self._cache_bytes + compute, self.files.layer_bytes())
        self._slots = [np.empty(plan.slot_bytes + _ALIGN, np.uint8) for _ in range(N_SLOTS * bool(plan.streamed))]
        self._slots = [s[(-s.ctypes.data) % _ALIGN:][:plan.slot_bytes] for s in self._slots]
        self.mlocked = all([_mlock(self.files.layers.get(l, [])) for l in plan.pinned])
        return plan

    def _run(self, g: GraphBuild) -> int:
        if self.plan_ is None:
            self.plan_ = self._make_plan()
        streamed = set(self.plan_.streamed)
        status = ggml.GGML_STATUS_SUCCESS
        views = _views(g)
        for segment, i0, i1 in _runs(g):
            if segment in streamed:
                self._bring_in(views, segment)
            view = ggml.ggml_graph_view(g.gf, i0, i1)
            status = ggml.ggml_backend_graph_compute(self.backend, ctypes.pointer(view))
            if status != ggml.GGML_STATUS_SUCCESS:
                break
        return status

    def _bring_in(self, views: dict[int, list], layer: int) -> None:
        """Wait for `layer` in its slot, point its tensors there, start reading the next one."""
        future = self._pending.pop(layer, None) or self._submit(layer)
        slot = future.result()
        base = slot.ctypes.data
        for p in self.files.layers[layer]:
            p.tensor.contents.data = base + p.slot_offset
            for v in views.get(ctypes.addressof(p.tensor.contents), ()):  # ggml-alloc set them from the old address
                v.data = base + p.slot_offset + v.view_offs
        order = self.plan_.streamed
        nxt = order[(order.index(layer) + 1) % len(order)]
        if nxt != layer and nxt not in self._pending:
            self._pending[nxt] = self._submit(nxt)

    def _submit(self, layer: int) -> Future:
        slot = self._slots[self._loads % N_SLOTS]
        self._loads += 1
        return self._pool.submit(self._read, layer, slot)

    def _read(self, layer: int, slot: np.ndarray) -> np.ndarray:
        self.bytes_read += read_layer(self.files.layers[layer], slot)
        return slot

    def summary(self) -> list[tuple[str, str]]:
        """print_info rows: what is pinned and what each token reads."""
        p = self.plan_
        if p is None:
            return [("mem budget", f"{self.budget} bytes (plan made at the first graph)")]
        return [("mem budget", f"{self.budget} bytes, resident {p.resident} (fixed {p.fixed})"),
                ("mem pinned", f"layers {_span(p.pinned)} ({p.pinned_bytes} bytes, "
                               f"mlock {'on' if self.mlocked else 'refused'})"),
                ("mem streamed", f"layers {_span(p.streamed)}: {p.streamed_bytes} bytes read per token, "
                                 f"{N_SLOTS} slots of {p.slot_bytes}")]

    def free(self) -> None:
        for f in list(self._pending.values()):
            f.result()
        self._pending = {}
        self._pool.shutdown()
        self.files.close()
        super().free()


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers else "none"


def _runs(g: GraphBuild):
    """(segment, first node, end) of each run of consecutive nodes of one segment."""
    n = ggml.ggml_graph_n_nodes(g.gf)
    runs: list[list] = []
    for i in range(n):
        seg = g.segment_of(ggml.ggml_graph_node(g.gf, i))
        if runs and (seg is None or seg == runs[-1][0]):
            runs[-1][2] = i + 1
        else:
            runs.append([seg, i, i + 1])
    return [tuple(r) for r in runs]


def _views(g: GraphBuild) -> dict[int, list]:
    """The graph's views of tensors it does not compute (weights), by the viewed tensor's address."""
    out: dict[int, list] = {}
    for i in range(ggml.ggml_graph_n_nodes(g.gf)):
        t = ggml.ggml_graph_node(g.gf, i).contents
        if t.view_src and t.view_src.contents.op == ggml.GGML_OP_NONE:
            out.setdefault(ctypes.addressof(t.view_src.contents), []).append(t)
    return out
