"""Per-op CPU time of one graph: each node computed on its own, timed by the calling thread's CPU clock.

On a machine shared with other processes, wall-clock time of a 2-thread graph mostly measures
who else got the cores (a thread preempted at one of the ~600 per-node barriers stalls the other).
With one thread, ggml's CPU backend computes in the calling thread, so `time.thread_time` around
each node counts that node's own work only: it is the figure that says where a path spends its
time, independent of the load. Computing node by node (ggml_graph_view of one node) gives the
same results as the whole graph: the allocation is the graph's, only the launches differ.
"""
from __future__ import annotations

import ctypes
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import ggml

from ggml_graph_spec.backends.cpu import Executor


def _profiled_run(records: list):
    """An Executor._run that computes node by node and appends [(op, seconds)] to records."""
    def run(self: Executor, g) -> int:
        rec, status = [], ggml.GGML_STATUS_SUCCESS
        for i in range(ggml.ggml_graph_n_nodes(g.gf)):
            one = ggml.ggml_graph_view(g.gf, i, i + 1)
            t = time.thread_time()
            status = ggml.ggml_backend_graph_compute(self.backend, ctypes.pointer(one))
            rec.append((ggml.ggml_op_desc(ggml.ggml_graph_node(g.gf, i)).decode(), time.thread_time() - t))
            if status != ggml.GGML_STATUS_SUCCESS:
                break
        records.append(rec)
        return status
    return run


@contextmanager
def profiling(records: list) -> Iterator[None]:
    """Within the block, every Executor graph is computed node by node into `records`."""
    plain = Executor._run
    Executor._run = _profiled_run(records)
    try:
        yield
    finally:
        Executor._run = plain


def per_op(runs: list[list[tuple[str, float]]]) -> dict[str, float]:
    """Seconds per op kind: the minimum over runs of each node (same graph each run), summed by op."""
    out: dict[str, float] = defaultdict(float)
    for i, (op, _) in enumerate(runs[0]):
        out[op] += min(r[i][1] for r in runs)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
