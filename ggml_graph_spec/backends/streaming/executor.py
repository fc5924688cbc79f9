"""Layers read from the file per token through rotating slots, the next one read while the
current one computes; of a MoE layer, only the experts its tokens select (backends/streaming/experts.py).

The graph is built and allocated as always (weights mapped from the file); only its compute
changes: the executor runs it one segment (layer) at a time through `ggml_graph_view`, and
before a streamed layer's segment points that layer's trunk tensors (everything but the routed
experts; and the graph's views of them, whose addresses ggml-alloc fixed from the mapping) at a
slot the prefetch thread filled: one read per run of adjacent tensors (a layer's trunk is one
in a GGUF), laid out in the slot as in the file so that O_DIRECT reads it straight in. A MoE
layer's segment is run in parts: up to the router's top-k ids; the executor reads them back, has
the expert cache hold those experts (starting the reads of the missed ones, in slot order) and
computes, while they are read, the nodes that do not need them (the shared experts); it writes
their cache entries into the ids input of the expert matmuls (the router's own ids, which the
gating weights' get_rows read, are left as they are); then the experts compute from the cache,
on the fast path one slot at a time (moe._routed_experts_by_slot), each as soon as its entries
are in. When a batch selects more experts than the cache holds, the layer's mapped expert
stacks are used whole and their pages dropped after. The plan is made before the first graph is
built, from a graph planned for the purpose (`wants_plan`): its compute buffer is part of it.
Reads are large and sequential and go around the page cache (or their pages are dropped after,
POSIX_FADV_DONTNEED, where the file system refuses O_DIRECT), so the page cache holds none of the
streamed bytes and the pinned prefix keeps its pages (mlock, best effort).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import ggml
import numpy as np

from gguf_arch.io.direct_io import BLOCK

from ...graph.build import I32, GraphBuild
from ..cpu import Executor
from .budget import N_SLOTS, BudgetError, BudgetPlan, plan_budget
from .experts import ExpertCache, ExpertStack
from .layer_files import LayerFiles, read_layer

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mlock(addr: int, nbytes: int) -> bool:
    """Pin mapped pages; False where the kernel refuses (RLIMIT_MEMLOCK)."""
    return _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes)) == 0


def _drop_mapped(stacks: list[ExpertStack]) -> None:
    """Drop the pages of mapped expert stacks the graph read in place (whole pages inside only:
    a neighbour's pinned pages stay)."""
    page = mmap.PAGESIZE
    for s in stacks:
        start, end = s.tensor.contents.data, s.tensor.contents.data + s.stride * s.count
        lo, hi = -(-start // page) * page, end // page * page
        if hi > lo:
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
        os.posix_fadvise(s.fd, s.file_offset, s.stride * s.count, os.POSIX_FADV_DONTNEED)


@dataclass
class _Bound:
    """A MoE layer of one graph whose experts come from the cache."""

    ids: object  # the router's top-k ids, I32 [k, T]
    slots: object  # the ids input of the expert matmuls
    pool: list  # one tensor per kind over the cache's regions

    def reads(self) -> set[int]:
        return {ctypes.addressof(t.contents) for t in (self.slots, *self.pool)}


class StreamingExecutor(Executor):
    """The CPU executor with a memory budget (module docstring). The plan is made at the first
    graph, when the compute buffer's size is known; `attach` gives it the caches' size."""

    segments = True  # each layer's nodes contiguous, in order (GraphBuild.begin_segment)

    def __init__(self, weights, budget: int, n_threads: int, exact: bool = False):
        super().__init__(n_threads)
        self.budget = budget
        self.pitched = not exact  # the expert cache's layout (backends/streaming/experts.py)
        self.files = LayerFiles(weights)
        self._used = weights.cfg.num_experts_used
        self.plan_: BudgetPlan | None = None
        self.cache: ExpertCache | None = None
        self.mlocked = False
        self.bytes_read = 0  # trunks and experts read by pread
        self.whole_reads = 0  # MoE layers whose experts were used from the mapping, whole
        self.tokens = 0
        self._cache_bytes = 0
        self._slots: list[np.ndarray] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kimi-k3-prefetch")
        self._pending: dict[int, Future] = {}
        self._ahead: dict[int, tuple] = {}  # the graph being run's _predicted
        self._guessed: dict[int, set] = {}  # MoE layer -> the experts predicted for it, until it runs
        self.guess_right = self.guess_total = 0  # of the layers' selected experts, how many were predicted
        self._loads = 0
        self._bound: dict[int, _Bound] = {}
        self._predicted: dict[int, tuple] = {}  # segment -> (a later MoE layer, its experts predicted there)

    def attach(self, cache_bytes: int) -> None:
        self._cache_bytes = cache_bytes

    @property
    def wants_plan(self) -> bool:
        """Until the budget's plan exists: it needs a planned graph's compute buffer, and the
        graph to compute needs the plan (which layers' experts come from the cache)."""
        return self.plan_ is None

    def _plan(self, g: GraphBuild) -> None:
        super()._plan(g)
        if self.plan_ is None:
            self.plan_ = self._make_plan()

    def _make_plan(self) -> BudgetPlan:
        compute = ggml.ggml_gallocr_get_buffer_size(self._galloc, 0)
        sizes = self.files.expert_sizes(self._used, self.pitched)
        if sizes is None and self.files.experts:
            raise BudgetError("--mem-budget: the MoE layers' routed experts differ in shape; one expert cache "
                              "cannot hold them")
        fixed = self.files.outside + self._cache_bytes + compute + N_SLOTS * self.files.slot_excess()
        plan = plan_budget(self.budget, fixed, self.files.layer_bytes(),
                           sizes)
        slot = max([0, *(self.files.slot_sizes.get(l, 0) for l in plan.streamed)])  # within plan.slot_bytes + excess
        self._slots = [np.empty(slot + BLOCK, np.uint8) for _ in range(N_SLOTS * bool(plan.streamed))]
        self._slots = [s[(-s.ctypes.data) % BLOCK:][:slot] for s in self._slots]  # O_DIRECT's alignment
        if plan.cache_entries:
            kinds = [s.shape for s in self.files.experts[plan.expert_layers[0]]]
            self.cache = ExpertCache(kinds, plan.cache_entries, ggml.ggml_backend_get_default_buffer_type(self.backend),
                                     self.pitched)
        pinned = [(p.tensor.contents.data, p.nbytes) for l in plan.pinned for p in self.files.layers.get(l, [])]
        if not plan.expert_layers:  # the whole model fits: its experts are pinned too
            pinned += [(s.tensor.contents.data, s.stride * s.count) for v in self.files.experts.values() for s in v]
        self.mlocked = all([_mlock(a, n) for a, n in pinned])
        return plan

    def bind_experts(self, g: GraphBuild, layer: int, ids, experts: list) -> tuple[object, list]:
        """GraphBuild's hook for a MoE layer's routed experts: the ids and expert tensors its
        matmuls are to read. A layer whose experts are streamed reads the cache's entries."""
        if self.cache is None or layer not in self.plan_.expert_layers:
            return ids, experts
        ggml.ggml_set_output(ids)  # kept until the executor has read it back
        k, T = ids.contents.ne[0], ids.contents.ne[1]
        slots = g.input(f"expert_entries_{layer}", I32, (k, T), np.zeros((T, k), np.int32))
        ggml.ggml_set_output(slots)
        names = [ggml.ggml_get_name(t) + b" (cache)" for t in experts]
        pool = self.cache.tensors(g.ctx, names, self.files.experts[layer])
        self._bound[layer] = _Bound(ids, slots, pool)
        return slots, pool

    def predict_experts(self, g: GraphBuild, layer: int, build) -> None:
        """GraphBuild's hook in an earlier layer (model._predict_experts): `build()` makes MoE
        layer `layer`'s predicted ids there, in the segment being built. Asked for where that
        layer's experts come from the cache and its trunk (its router) is resident: a streamed
        trunk is not in a slot yet."""
        p = self.plan_
        if p is None or self.cache is None or layer in p.streamed or layer not in p.expert_layers:
            return
        ids = build()
        ggml.ggml_set_output(ids)
        g.expand(ids)
        self._predicted[g.segment_of(ids)] = (layer, ids)

    def _run(self, g: GraphBuild) -> int:
        if self.plan_ is None:
            self.plan_ = self._make_plan()
        bound, self._bound = self._bound, {}
        self._ahead, self._predicted = self._predicted, {}
        streamed, experts = set(self.plan_.streamed), set(self.plan_.expert_layers)
        runs, views, nodes = _scan(g)
        self.tokens += g.n_tokens
        for segment, i0, i1 in runs:
            if segment in streamed:
                self._bring_in(views, segment)
            if segment in bound:
                status = self._run_moe(g, (views, nodes), segment, bound[segment], (i0, i1))
            else:
                status = self._run_plain(g, nodes, segment, (i0, i1))
                if segment in experts:  # a graph built before the plan (Executor.plan): the mapped experts
                    self._whole(segment)
            if status != ggml.GGML_STATUS_SUCCESS:
                break
        return status

    def _compute(self, g: GraphBuild, i0: int, i1: int) -> int:
        if i0 >= i1:
            return ggml.GGML_STATUS_SUCCESS
        view = ggml.ggml_graph_view(g.gf, i0, i1)
        return ggml.ggml_backend_graph_compute(self.backend, ctypes.pointer(view))

    def _run_plain(self, g: GraphBuild, nodes: list[int], segment: int, run: tuple[int, int]) -> int:
        """A segment whose experts (if any) are not the cache's. One that predicts a later MoE
        layer's (the first layer, or a dense layer before a MoE one) is run up to the prediction,
        the predicted experts' reads started, then the rest: the compute up to that layer's
        selection hides them."""
        (i0, i1), nxt = run, self._ahead.get(segment)
        if nxt is None or self.cache is None:
            return self._compute(g, i0, i1)
        split = nodes.index(ctypes.addressof(nxt[1].contents), i0, i1) + 1
        status = self._compute(g, i0, split)
        if status == ggml.GGML_STATUS_SUCCESS:
            self.cache.read_ahead(*self._guess(nxt))
            status = self._compute(g, split, i1)
        return status

    def _run_moe(self, g: GraphBuild, scan: tuple, layer: int, b: _Bound, run: tuple[int, int]) -> int:
        """The layer up to its router's ids; the selected experts brought in, and while the missed
        ones are read the nodes up to the expert matmuls (the shared experts: blocks/moe.py builds
        them there); then the rest (_run_experts)."""
        (views, nodes), (i0, i1) = scan, run
        split = _first_reader(nodes, b.reads(), i0, i1)
        routed = nodes.index(ctypes.addressof(b.ids.contents), i0, split) + 1
        status = self._compute(g, i0, routed)
        if status != ggml.GGML_STATUS_SUCCESS:
            return status
        ids = self.read(b.ids).astype(np.int32)  # [T, k]
        experts, first, inverse = np.unique(ids.T.ravel(), return_index=True, return_inverse=True)  # slot-major
        order = np.argsort(first)  # the distinct experts in slot order: the misses are read in it
        self._score(layer, experts)
        meanwhile = []
        entries = self.cache.place(layer, self.files.experts[layer], experts[order], self._guess(self._ahead.get(layer)),
                                   during=lambda: meanwhile.append(self._compute(g, routed, split)), settle=False)
        if meanwhile[0] != ggml.GGML_STATUS_SUCCESS:
            return meanwhile[0]
        if entries is None:  # more experts than the cache holds: the mapped stacks, whole
            for t, s in zip(b.pool, self.files.experts[layer]):  # (the pitched path has no view to restride)
                _point(views, t, s.tensor.contents.data)
                t.contents.nb[2], t.contents.nb[3] = s.stride, s.stride * t.contents.ne[2]
            value = ids
        else:
            held = np.empty_like(entries)
            held[order] = entries  # by expert, as np.unique sorted them
            value = held[inverse].reshape(ids.shape[::-1]).T
        value = np.ascontiguousarray(value, dtype=np.int32)
        ggml.ggml_backend_tensor_set(b.slots, value.ctypes.data_as(ctypes.c_void_p), 0, value.nbytes)
        status = self._run_experts(g, nodes, b, (split, i1), None if entries is None else value)
        if entries is None:
            self._whole(layer)
        return status

    def _run_experts(self, g: GraphBuild, nodes: list[int], b: _Bound, run: tuple[int, int],
                     entries: np.ndarray | None) -> int:
        """Nodes run[0]..run[1], from the routed experts on. Where the graph has one slot's
        experts at a time (moe._routed_experts_by_slot), each slot as soon as its own `entries`
        (the cache's, [T, k]) are in, the first slots computing while the later ones are read;
        else (the exact path's batched experts, or the mapped stacks: `entries` None) after all."""
        split, i1 = run
        starts = _slot_starts(nodes, b.slots, split, i1)
        if entries is None or len(starts) != entries.shape[1]:
            starts = [split]
        status = ggml.GGML_STATUS_SUCCESS
        for j, (a, z) in enumerate(zip(starts, [*starts[1:], i1])):
            if entries is not None:
                self.cache.ready(entries[:, j] if len(starts) > 1 else entries.ravel())
            status = self._compute(g, a, z)
            if status != ggml.GGML_STATUS_SUCCESS:
                break
        if entries is not None:
            self.cache.ready(entries.ravel())  # (a failed compute left some in flight)
        return status

    def _score(self, layer: int, experts: np.ndarray) -> None:
        """Count the prediction made for `layer` (if any) against its selection."""
        guessed = self._guessed.pop(layer, None)
        if guessed is not None:
            self.guess_right += len(guessed & set(experts.tolist()))
            self.guess_total += len(experts)

    def _guess(self, prediction: tuple | None) -> tuple | None:
        """A prediction's (MoE layer, ids) experts as ExpertCache.read_ahead and place's `ahead`
        take them: that layer, its stacks, the experts (none: None)."""
        if prediction is None:
            return None
        layer, ids = prediction
        predicted = np.array(list(dict.fromkeys(self.read(ids).ravel().tolist())), np.int64)  # in the order given
        self._guessed[layer] = set(predicted.tolist())
        return layer, self.files.experts[layer], predicted

    def _whole(self, layer: int) -> None:
        self.whole_reads += 1
        _drop_mapped(self.files.experts[layer])

    def _bring_in(self, views: dict[int, list], layer: int) -> None:
        """Wait for `layer` in its slot, point its tensors there, start reading the next one."""
        future = self._pending.pop(layer, None) or self._submit(layer)
        slot = future.result()
        for p in self.files.layers.get(layer, []):
            _point(views, p.tensor, slot.ctypes.data + p.slot_offset)
        order = self.plan_.streamed
        nxt = order[(order.index(layer) + 1) % len(order)]
        if nxt != layer and nxt not in self._pending:
            self._pending[nxt] = self._submit(nxt)

    def _submit(self, layer: int) -> Future:
        slot = self._slots[self._loads % N_SLOTS]
        self._loads += 1
        return self._pool.submit(self._read, layer, slot)

    def _read(self, layer: int, slot: np.ndarray) -> np.ndarray:
        self.bytes_read += read_layer(self.files.runs.get(layer, []), slot)
        return slot

    def read_per_token(self) -> float:
        """Bytes pread per token so far (trunks and missed experts)."""
        return (self.bytes_read + (self.cache.bytes_read if self.cache else 0)) / max(self.tokens, 1)

    def summary(self) -> list[tuple[str, str]]:
        """print_info rows: what is pinned, the expert cache and what each token reads."""
        p = self.plan_
        if p is None:
            return [("mem budget", f"{self.budget} bytes (plan made at the first graph)")]
        what = "trunks of layers" if p.expert_layers else "layers"
        return [("mem budget", f"{self.budget} bytes, resident {p.resident} (fixed {p.fixed})"),
                ("mem pinned", f"{what} {_span(p.pinned)} ({p.pinned_bytes} bytes, "
                               f"mlock {'on' if self.mlocked else 'refused'})"),
                ("mem streamed", f"{what} {_span(p.streamed)}: {p.streamed_bytes} bytes read per token, "
                                 f"{N_SLOTS} slots of {p.slot_bytes}")] + self.stats()

    def stats(self) -> list[tuple[str, str]]:
        """print_info rows of the expert cache so far (also printed at the end of a run)."""
        p, c = self.plan_, self.cache
        if p is None or c is None:
            return []
        return [("mem experts", f"layers {_span(p.expert_layers)}: cache of {c.entries} experts ({c.nbytes} bytes), "
                                f"hits {c.hits}/{c.hits + c.misses} ({100 * c.hit_rate():.1f}%), at most "
                                f"{self._used * len(p.expert_layers)} experts of {p.expert_bytes} bytes read per token; "
                                f"prefetched {c.predicted}: useful {c.useful}, wasted {c.wasted} "
                                f"({c.wasted_bytes} bytes read), predicted right {self.guess_right}/"
                                f"{self.guess_total} selected"),
                ("mem read", f"{self.read_per_token():.0f} bytes read per token so far ({self.tokens} tokens, "
                             f"{self.whole_reads} layer(s) of experts used whole)")]

    def free(self) -> None:
        for f in list(self._pending.values()):
            f.result()
        self._pending = {}
        self._pool.shutdown()
        if self.cache is not None:
            self.cache.free()
        self.files.close()
        super().free()


def _point(views: dict[int, list], t, addr: int) -> None:
    """Move a weight tensor (and the graph's views of it, whose addresses ggml-alloc set) to addr."""
    t.contents.data = addr
    for v in views.get(ctypes.addressof(t.contents), ()):
        v.data = addr + v.view_offs


_SRC = ggml.ggml_tensor.src.offset  # the struct's src pointers, read as integers (one ctypes read)


def _first_reader(nodes: list[int], tensors: set[int], i0: int, i1: int) -> int:
    """The first node in i0..i1 (addresses `nodes`) with a source among `tensors`."""
    for i in range(i0, i1):
        if any(s in tensors for s in (ctypes.c_void_p * ggml.GGML_MAX_SRC).from_address(nodes[i] + _SRC)):
            return i
    return i1


def _slot_starts(nodes: list[int], slots, i0: int, i1: int) -> list[int]:
    """The nodes in i0..i1 that are views of the expert-entries input `slots`: where each slot of
    moe._routed_experts_by_slot starts (none where the experts are batched)."""
    at = ctypes.addressof(slots.contents)
    starts = []
    for i in range(i0, i1):
        t = ggml.ggml_tensor.from_address(nodes[i])
        if t.op == ggml.GGML_OP_VIEW and t.view_src and ctypes.addressof(t.view_src.contents) == at:
            starts.append(i)
    return starts


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers else "none"


def _scan(g: GraphBuild) -> tuple[list[tuple], dict[int, list], list[int]]:
    """One pass over the nodes (per graph: it costs Python time per node): the (segment, first
    node, end) of each run of consecutive nodes of one segment; the graph's views of tensors it
    does not compute (weights, the cache's), by the viewed tensor's address; each node's address."""
    segments = g.segments_by_address()
    runs: list[list] = []
    views: dict[int, list] = {}
    nodes: list[int] = []
    for i in range(ggml.ggml_graph_n_nodes(g.gf)):
        t = ggml.ggml_graph_node(g.gf, i).contents
        nodes.append(ctypes.addressof(t))
        seg = segments.get(nodes[-1])
        if runs and (seg is None or seg == runs[-1][0]):
            runs[-1][2] = i + 1
        else:
            runs.append([seg, i, i + 1])
        if t.view_src and t.view_src.contents.op == ggml.GGML_OP_NONE:
            views.setdefault(ctypes.addressof(t.view_src.contents), []).append(t)
    return [tuple(r) for r in runs], views, nodes
