"""The local CPU backend: one ggml-alloc allocator kept for the life of a model, and the graphs
computed on ggml's CPU backend. The executors over RPC devices (sched.py) and within a memory
budget (streaming/) derive from it."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import ggml
import numpy as np

from gguf_arch.errors.signals import native_call

from ..graph.build import NUMPY_OF, GraphBuild


class Executor:
    """The CPU backend and one ggml-alloc allocator, kept for the life of a model.

    Each call's graph is placed by the same allocator: its buffer is reused from call to call
    and only grows when a graph needs more (a prefill after token-by-token decode, say).
    """

    segments = False  # GraphBuild(segments=...): whether compute needs the tensors' segments
    bind_experts = None  # GraphBuild(bind_experts=...): a hook placing the routed experts (None: in place)
    predict_experts = None  # GraphBuild(predict_experts=...): a hook reading the next layer's experts early
    wants_plan = False  # True: plan a graph built for the purpose before the next one is built and computed
    may_stall = False  # a graph's compute may wait on an RPC server (signals.native_call)

    def __init__(self, n_threads: int):
        self.backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self.backend, n_threads)
        self._galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))

    @contextmanager
    def graph(self, n_nodes: int, make: Callable[[Any, Any], GraphBuild]) -> Iterator[GraphBuild]:
        """A fresh no-alloc context and graph for one call; freed on exit."""
        ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * n_nodes * 2 + ggml.ggml_graph_overhead_custom(n_nodes, False),
            mem_buffer=None, no_alloc=True))
        try:
            yield make(ctx, ggml.ggml_new_graph_custom(ctx, n_nodes, False))
        finally:
            ggml.ggml_free(ctx)

    def compute(self, g: GraphBuild, outputs: Iterable[Any]) -> None:
        """Allocate g's graph (outputs kept alive), upload its inputs, run it. A stop signal
        meanwhile ends the process at once (native_call: a graph may run for minutes, or wait
        on a server)."""
        self._expand_outputs(g, outputs)
        with native_call(self.may_stall):
            self._allocate(g)
            for t, value in g.input_arrays():
                if not t.contents.buffer:  # an input no node reads is not allocated
                    continue
                ggml.ggml_backend_tensor_set(t, value.ctypes.data_as(ctypes.c_void_p), 0, value.nbytes)
            status = self._run(g)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml graph compute failed with status {status}")

    def plan(self, g: GraphBuild, outputs: Iterable[Any]) -> None:
        """Plan the memory of g's graph (outputs kept alive) without computing it.

        ggml-alloc reuses its last plan for the next graph when it has as many nodes and leafs
        and every tensor fits, whatever that graph's outputs are: an output the old plan did not
        keep would be overwritten before it is read. A graph with outputs beyond the logits
        (records) is planned first from an identical graph built for the purpose: the
        scheduler's planning rewrites the graph it is given."""
        self._expand_outputs(g, outputs)
        self._plan(g)

    def measure(self, g: GraphBuild, outputs: Iterable[Any]) -> int:
        """The bytes of compute buffer g's graph (outputs kept alive) needs; nothing is allocated."""
        self._expand_outputs(g, outputs)
        sizes = (ctypes.c_size_t * 1)()
        ggml.ggml_gallocr_reserve_n_size(self._galloc, g.gf, None, None, sizes)
        return int(sizes[0])

    def _expand_outputs(self, g: GraphBuild, outputs: Iterable[Any]) -> None:
        for t in outputs:
            ggml.ggml_set_output(t)
            g.expand(t)

    def _plan(self, g: GraphBuild) -> None:
        if not ggml.ggml_gallocr_reserve(self._galloc, g.gf):
            raise MemoryError("ggml-alloc could not allocate the compute graph")

    def _allocate(self, g: GraphBuild) -> None:
        if not ggml.ggml_gallocr_alloc_graph(self._galloc, g.gf):
            raise MemoryError("ggml-alloc could not allocate the compute graph")

    def _run(self, g: GraphBuild) -> int:
        return ggml.ggml_backend_graph_compute(self.backend, g.gf)

    @staticmethod
    def read(t) -> np.ndarray:
        """A contiguous output as [rows, ne0]: every output here is [width, n_tokens] (T = 1 too)."""
        out = np.empty((ggml.ggml_nrows(t), t.contents.ne[0]), dtype=NUMPY_OF[t.contents.type])
        with native_call(may_stall=True):  # from a server: a call on its socket
            ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
        return out

    def free(self) -> None:
        if self._galloc is not None:
            ggml.ggml_gallocr_free(self._galloc)
            self._galloc = None
            ggml.ggml_backend_free(self.backend)
