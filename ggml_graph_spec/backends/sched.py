"""Run the model's graphs over several backends with ggml's backend scheduler.

Every op node is pinned to the device of the graph segment that built it
(`GraphBuild.segment_of`, `Placement.device_of`): a layer's ops run where its weights and caches
are, and the scheduler only adds the copies between devices (a layer's inputs coming from the
previous device: the AttnRes partial sum, the banked block residuals, the masks). View ops are
left to the scheduler, which keeps a view on the device of the tensor it views.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Hashable, Sequence

import ggml

from ..graph.build import GraphBuild
from .cpu import Executor

# ggml_is_view_op (ggml-impl.h, not exported): ops whose result aliases their source.
_VIEW_OPS = frozenset({ggml.GGML_OP_VIEW, ggml.GGML_OP_RESHAPE, ggml.GGML_OP_PERMUTE, ggml.GGML_OP_TRANSPOSE})

# ggml-python 0.0.45 declares ggml_backend_sched_get_tensor_backend's result as the NewType
# ggml_backend_t (an int), which ctypes truncates to a C int: bind it with a pointer result.
_tensor_backend = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(ggml.lib.ggml_backend_sched_get_tensor_backend, ctypes.c_void_p).value)


class SchedExecutor(Executor):
    """Executor over `backends` (the CPU last, as ggml's scheduler requires)."""

    may_stall = True  # the other backends are RPC servers: a compute waits on their sockets

    def __init__(self, backends: Sequence, n_nodes: int, device_of: Callable[[Hashable], int],
                 check: Callable[[], None], buffer_types: Sequence | None = None):
        """buffer_types: the compute buffer type of each backend (None: their defaults)."""
        self.backends = list(backends)
        self.backend = self.backends[-1]  # the CPU: where graph inputs live
        self._device_of = device_of
        self._check = check  # raises before any ggml call if a device is gone
        array = (ggml.ggml_backend_t_ctypes * len(self.backends))(*self.backends)
        bufts = None if buffer_types is None else \
            (ggml.ggml_backend_buffer_type_t_ctypes * len(self.backends))(*buffer_types)
        # Node and leaf counts both go into the scheduler's hash set: room for both.
        self._sched = ggml.ggml_backend_sched_new(array, bufts, len(self.backends), 2 * n_nodes, False, False)
        if not self._sched:
            raise MemoryError("ggml could not create the backend scheduler")

    segments = True

    def _allocate(self, g: GraphBuild) -> None:
        self._check()
        self._pin(g)
        if not ggml.ggml_backend_sched_alloc_graph(self._sched, g.gf):
            raise MemoryError("ggml's scheduler could not allocate the compute graph")
        self._check_views(g)

    def _plan(self, g: GraphBuild) -> None:
        self._check()
        self._pin(g)
        # The scheduler replaces the sources that cross devices in g's nodes: g is not computed.
        if not ggml.ggml_backend_sched_reserve(self._sched, g.gf):
            raise MemoryError("ggml's scheduler could not allocate the compute graph")

    def _pin(self, g: GraphBuild) -> None:
        ggml.ggml_backend_sched_reset(self._sched)
        for i in range(ggml.ggml_graph_n_nodes(g.gf)):
            node = ggml.ggml_graph_node(g.gf, i)
            segment = g.segment_of(node)
            if segment is not None and node.contents.op not in _VIEW_OPS:
                ggml.ggml_backend_sched_set_tensor_backend(self._sched, node, self.backends[self._device_of(segment)])

    def backend_of(self, t) -> int | None:
        """The backend the scheduler gave t in the last graph (None: not placed)."""
        return _tensor_backend(self._sched, ctypes.addressof(t.contents))

    def _check_views(self, g: GraphBuild) -> None:
        """Every view node on the device of the run of nodes it sits in (see
        GraphBuild.begin_segment): ggml's scheduler would send a view of another device's
        tensor to this run's server, which rejects the graph and drops the connection."""
        nodes = [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]
        runs = [self.backend_of(n) for n in nodes if n.contents.op not in _VIEW_OPS]
        current = runs[0] if runs else None
        for n in nodes:
            if n.contents.op not in _VIEW_OPS:
                current = self.backend_of(n)
            elif self.backend_of(n) != current:
                raise RuntimeError(f"internal error: view {n.contents.name.decode()} of segment {g.segment_of(n)!r} "
                                   "sits among another device's nodes in the graph order")

    def _run(self, g: GraphBuild) -> int:
        return ggml.ggml_backend_sched_graph_compute(self._sched, g.gf)

    def buffer_size(self, backend) -> int:
        """Bytes of the scheduler's compute buffer on `backend` (as large as the largest graph yet)."""
        return ggml.ggml_backend_sched_get_buffer_size(self._sched, backend)

    def n_splits(self) -> int:
        """Graph splits of the last graph (one per run of nodes on one device)."""
        return ggml.ggml_backend_sched_get_n_splits(self._sched)

    def free(self) -> None:
        """Free the scheduler (its compute buffers on every device) and the CPU backend; the
        RPC backends belong to the caller."""
        if self._sched is not None:
            ggml.ggml_backend_sched_free(self._sched)
            self._sched = None
            ggml.ggml_backend_free(self.backend)
